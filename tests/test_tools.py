"""Tool calls: parsing `<tool_call>` blocks whole and streamed in any cut, templates with and
without tools, the grammar of tool_choice, and the Python API on SmolLM2."""

import json

import pytest

from via_edge import Engine
from via_edge.errors import InvalidParameterError
from via_edge.openai_api.toolcalls import CallStream, Tools, parse_calls, template_messages

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
    prose += split.flush()
    assert prose.strip() == "Let me check." and calls == [{"city": "Paris"}, {"city": "Rome"}]


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
