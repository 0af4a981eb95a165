"""The OpenAI surface agents use, against a live `via-edge serve` on SmolLM2 with real clients:
JSON-schema output, a two-turn tool loop, streamed tool calls, logprobs, LangChain's structured
output and tool binding, and a 400 naming every field via-edge does not do."""

import json

import httpx
import openai
import pytest

from test_server import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(["--target", smollm2, "--mode", "lookup", "--ctx", "4096", "--parallel", "2"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model="via-edge", temperature=0, **kw)


def test_json_schema_response_format_validates(client):
    out = chat(client, messages=[{"role": "user", "content": "Invent a person."}],
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    data = json.loads(out.choices[0].message.content)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int) and 0 <= data["age"] <= 150
    assert len(data["name"]) <= 16
    # llama-server's json_object with a schema; a bare json_object is an object unless it ran out of tokens
    schema = chat(client, messages=[{"role": "user", "content": "Invent a person."}],
                  response_format={"type": "json_object", "schema": PERSON})
    assert set(json.loads(schema.choices[0].message.content)) == {"name", "age"}
    free = chat(client, messages=[{"role": "user", "content": "Invent a person."}], response_format={"type": "json_object"})
    assert free.choices[0].message.content.startswith("{")
    assert free.choices[0].finish_reason == "length" or isinstance(json.loads(free.choices[0].message.content), dict)


def test_a_two_turn_tool_loop(client):
    first = chat(client, tools=[WEATHER, TIME], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}
    second = chat(client, messages=ASK + [turn, result], tools=[WEATHER, TIME], tool_choice="none")
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_a_named_tool_choice_calls_that_function(client):
    out = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["zone"], str)


def test_streamed_tool_calls_reassemble_to_the_whole_answer(client):
    whole = chat(client, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls[0]
    name, args, finish, ids = "", "", None, set()
    for chunk in chat(client, tools=[WEATHER], tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            ids.add(tc.id) if tc.id else None
            name += tc.function.name or "" if tc.function else ""
            args += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    assert name == whole.function.name and json.loads(args) == json.loads(whole.function.arguments)


def test_logprobs_shapes_chat_and_completions(client):
    out = chat(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, logprobs=True,
               top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        top = [t.logprob for t in c.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert c.token == c.top_logprobs[0].token and c.logprob == pytest.approx(top[0])  # greedy: the best
    comp = client.completions.create(model="via-edge", prompt="The capital of France is", max_tokens=6,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == comp.choices[0].text
    start = len("The capital of France is")  # offsets count from the prompt's start, as OpenAI's
    assert lp.text_offset == [start + sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(alts) == 2 for alts in lp.top_logprobs)


def test_logit_bias_and_penalties_change_the_answer(client, smollm2):
    from via_edge.llama import LlamaModel, LoadParams

    ask = [{"role": "user", "content": "Repeat the word cat ten times."}]
    plain = chat(client, messages=ask, max_tokens=24, logprobs=True, top_logprobs=1)
    first = plain.choices[0].logprobs.content[0]
    with LlamaModel(smollm2, LoadParams(n_ctx=64)) as vocab:
        (token,) = vocab.tokenize(bytes(first.bytes), add_special=False)
    banned = chat(client, messages=ask, max_tokens=24, logprobs=True, top_logprobs=1, logit_bias={str(token): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token
    prompt = "cat cat cat cat cat cat cat cat"
    again = client.completions.create(model="via-edge", prompt=prompt, max_tokens=8, temperature=0)
    fresh = client.completions.create(model="via-edge", prompt=prompt, max_tokens=8, temperature=0,
                                      frequency_penalty=2.0, presence_penalty=2.0)
    assert again.choices[0].text != fresh.choices[0].text  # the exact rules are test_constraints' business


def test_langchain_structured_output_and_tools(server):
    import langchain_openai  # the test extra brings it
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=150)

    llm = langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key="none", model="via-edge", temperature=0,
                                      max_tokens=96, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)
    bound = llm.bind_tools([WEATHER], tool_choice="required")
    msg = bound.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"], dict)


CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")


def test_predicted_outputs_through_the_sdk_leave_the_answer_as_it_was(smollm2, tmp_path, monkeypatch):
    """OpenAI's `prediction=` as editors send it (the file the answer rewrites), streamed and not:
    the same answer, drafted from the prediction (timings), and usage counting the prediction's
    tokens found in the answer and those not. Exact kernels, flash attention (its CPU kernel takes
    each query row alone; without it the attention's matrix products pick kernels by batch shape,
    and on an AVX2-only EPYC an F32 KV cache then flipped this answer) and drafts of at most 6
    tokens, so verification computes what single decodes do and the answers compare token for token; a
    flat cost profile in the server's model directory, so that copies pay however busy the
    machine is while the suite runs."""
    from via_edge.decode import costs
    from via_edge.llama import EXACT, LlamaModel, LoadParams

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path / "models"))
    with LlamaModel(smollm2, LoadParams(n_ctx=2048, **EXACT)) as model:
        costs.store(model, {n: 0.01 for n in costs.VERIFY_BATCHES})
    with serving(["--target", smollm2, "--mode", "ar", "--exact", "--flash-attn", "--copy-max", "6",
                  "--ctx", "2048"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(messages=[{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}], max_tokens=80)
        plain = chat(client, **kw)
        text = plain.choices[0].message.content
        pred = {"type": "content", "content": text}
        res = chat(client, **kw, prediction=pred)
        assert res.choices[0].message.content == text
        details, timings = res.usage.completion_tokens_details, res.model_extra["timings"]
        assert timings["prediction_draft_n_accepted"] > 20
        assert details.accepted_prediction_tokens >= plain.usage.completion_tokens - 2
        assert details.rejected_prediction_tokens <= 2
        parts = {"type": "content", "content": [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]}
        chunks = list(chat(client, **kw, prediction=parts, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
            details.accepted_prediction_tokens


@pytest.mark.parametrize("path,extra,field", [
    ("chat/completions", {"n": 2}, "n"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": 5}, "suffix"),
    ("chat/completions", {"echo": True}, "echo"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"repeat_penalty": 0}, "repeat_penalty"),
    ("completions", {"tools": [WEATHER]}, "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools.0"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "mode": "via"}, "logprobs"),
    ("chat/completions", {"grammar": "root ::= [a-"}, "grammar"),
    ("chat/completions", {"prediction": {"type": "file", "content": "x"}}, "prediction.type"),
    ("chat/completions", {"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction.content"),
    ("completions", {"prediction": "x"}, "prediction"),
    ("completions", {"prediction": {"type": "content", "content": "x = 1\n" * 1200}}, "prediction"),  # > 2048 per slot
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_is_not_done_is_a_400_naming_the_field(server, path, extra, field, stream):
    body = {"model": "via-edge", "max_tokens": 4, "stream": stream, **extra}
    body |= {"messages": ASK} if path.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{server}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_server_request_is_checked_and_its_grammar_compiled_once(smollm2):
    """The server builds the engine's Request before the request queues and its worker runs that
    Request: one grammar compilation per request, streamed or not, and a grammar that does not
    parse is refused before it takes a slot."""
    from fastapi.testclient import TestClient

    from via_edge import Engine
    from via_edge.server.app import create_app

    with Engine(smollm2, mode="ar", n_ctx=1024) as engine:
        compile_grammar, compiled = engine.target.grammar, []
        engine.target.grammar = lambda gbnf: compiled.append(gbnf) or compile_grammar(gbnf)
        with TestClient(create_app(engine)) as http:
            body = {"messages": ASK, "max_tokens": 8, "temperature": 0, "grammar": 'root ::= "yes" | "no"'}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no")
            assert len(compiled) == 1
            with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
            assert len(compiled) == 2
            r = http.post("/v1/chat/completions", json=body | {"grammar": "root ::= [a-"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
            assert len(compiled) == 3 and http.get("/health").json()["served"] == 2  # it never reached a slot


def test_a_stream_with_tools_ends_with_its_usage_chunk(client):
    """stream_options.include_usage holds with tools as without: the last chunk carries usage and
    no choices, after the tool-call deltas and the finishing chunk (it was never sent with tools)."""
    chunks = list(chat(client, tools=[WEATHER], tool_choice="required", stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert all(c.usage is None for c in chunks[:-1])


def test_engine_chat_ends_a_call_with_finish_reason_tool_calls(smollm2):
    from via_edge import Engine

    with Engine(smollm2, mode="ar", n_ctx=2048) as engine:
        res = engine.chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=96)
        plain = engine.chat(ASK, max_tokens=8)
    assert res.tool_calls and res.finish_reason == "tool_calls"
    assert plain.tool_calls is None and plain.finish_reason in ("stop", "length")
