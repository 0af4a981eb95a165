"""Tool calls: parsing `<tool_call>` blocks whole and streamed in any cut, templates with and
without tools, the grammar of tool_choice, and the Python API on SmolLM2."""

import json

import pytest

from via_edge import Engine
from via_edge.errors import InvalidParameterError
from via_edge.openai_api.callparse import CallStream, parse_calls
from via_edge.openai_api.toolcalls import Tools, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_calls_are_parsed_and_prose_kept():
    content, calls = parse_calls(ANSWER)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls("no calls <tool_call>not json</tool_call>") == ("no calls <tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 11, 1000])
def test_a_stream_cut_anywhere_gives_the_same_calls_and_prose(cut):
    split, prose, calls = CallStream(), "", []
    for i in range(0, len(ANSWER), cut):
        for part in split.feed(ANSWER[i:i + cut]):
            if isinstance(part, str):
                assert "<tool_call>" not in part  # a block never leaks out as text
                prose += part
            else:
                calls.append(json.loads(part["function"]["arguments"]))
    prose += "".join(p for p in split.flush() if isinstance(p, str))
    assert prose.strip() == "Let me check." and calls == [{"city": "Paris"}, {"city": "Rome"}]


NAMES = {"get_weather", "get_time"}
PARIS, CET = {"city": "Paris"}, {"zone": "CET"}
# the forms Qwen2.5-Coder-1.5B (and Llama 3.x, Mistral) write calls in, as recorded answers
FORMS = [
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None, [PARIS]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    ('{{"name": "get_weather", "arguments": {"city": "Paris"}}}', None, [PARIS]),
    ('{{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),  # one closing brace short
    ('I will check both.\n```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
     '```json\n{"name": "get_time", "arguments": {"zone": "CET"}}\n```', "I will check both.", [PARIS, CET]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [PARIS, CET]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),  # cut before the fence closed
]
NOT_CALLS = [
    'Here is the record: {"name": "Alice", "age": 3}',            # JSON naming no declared function
    '```json\n{"city": "Paris", "name": "get_weather"}\n```',    # a call opens with its name
    '```python\ndef f(x):\n    return {"name": x}\n```',
    "Use a dict like {1: 2} or a list [1, 2]; `code` and <b>tags</b> stay text.",
]


def streamed(text: str, cut: int) -> tuple[str, list[dict]]:
    split, prose, calls = CallStream(NAMES), "", []
    parts = [p for i in range(0, len(text), cut) for p in split.feed(text[i:i + cut])] + split.flush()
    for part in parts:
        if isinstance(part, str):
            prose += part
        else:
            calls.append(part)
    return prose, calls


@pytest.mark.parametrize("text,content,args", FORMS)
def test_every_form_of_call_is_found_whole_and_streamed_in_any_cut(text, content, args):
    got_content, calls = parse_calls(text, NAMES)
    assert got_content == content and [json.loads(c["function"]["arguments"]) for c in calls] == args
    for cut in (1, 2, 3, 7, 1000):
        prose, scalls = streamed(text, cut)
        assert (prose.strip() or None) == content, cut
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in scalls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], cut


@pytest.mark.parametrize("text", NOT_CALLS)
def test_text_that_only_looks_like_json_stays_text(text):
    assert parse_calls(text, NAMES) == (text, [])
    for cut in (1, 4, 1000):
        assert streamed(text, cut) == (text, [])


def test_a_template_without_tools_gets_them_in_words():
    msgs, offered = template_messages([{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"id": "c1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                                      Tools.parse([WEATHER]), "{{ messages }}")
    assert offered is None and msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in msgs[2]["content"] and "<tool_call>" in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, offered = template_messages([{"role": "user", "content": "hi"}], Tools.parse([WEATHER]),
                                        "{% if tools %}{{ tools }}{% endif %}")
    assert offered and offered[0]["function"]["name"] == "get_weather" and native == [{"role": "user", "content": "hi"}]


def test_tool_choice_is_checked():
    for tools, choice, param in [([], None, "tools"), ([{"type": "function"}], None, "tools.0"),
                                 (None, "required", "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice")]:
        with pytest.raises(InvalidParameterError) as err:
            Tools.parse(tools, choice)
        assert err.value.param == param
    assert Tools.parse([WEATHER], "auto").grammar() is None and Tools.parse([WEATHER], "required").grammar()


def test_the_python_api_returns_calls(smollm2):
    with Engine(smollm2, n_ctx=1024) as engine:
        res = engine.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], tool_choice="required",
                          max_tokens=60)
    assert res.tool_calls and res.tool_calls[0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads(res.tool_calls[0]["function"]["arguments"])["city"], str)
