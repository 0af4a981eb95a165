"""Tool calls with the default model as agents ask for them: `tool_choice` left at `auto`, through
a real `via-edge serve` on the default pair, with the openai SDK (whole and streamed), a two-turn
loop and LangChain's `bind_tools` (docs/benchmarks.md, section 32).

    .venv/bin/python tools/tool_call_check.py [--port 8931]

Prints each answer's calls and how many of the prompts came back as `tool_calls`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASKS = ["What is the weather in Paris?", "Is it raining in Tokyo right now?", "How warm is it in Cairo today?",
        "Check the weather for Oslo, please.", "Tell me the current weather in Lima."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8931)
    args = ap.parse_args()
    import httpx
    import openai

    proc = subprocess.Popen([sys.executable, "-m", "via_edge", "serve", "--port", str(args.port), "--parallel", "1"],
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        ask = dict(model="x", tools=[WEATHER], temperature=0, max_tokens=96)
        whole = streamed = 0
        for q in ASKS:
            c = client.chat.completions.create(messages=[{"role": "user", "content": q}], **ask).choices[0]
            whole += bool(c.message.tool_calls) and c.finish_reason == "tool_calls"
            print("whole:", c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                  repr((c.message.content or "")[:60]))
            names, finish = [], None
            for ch in client.chat.completions.create(messages=[{"role": "user", "content": q}], stream=True, **ask):
                if ch.choices:
                    names += [t.function.name for t in ch.choices[0].delta.tool_calls or [] if t.function and t.function.name]
                    finish = ch.choices[0].finish_reason or finish
            streamed += bool(names) and finish == "tool_calls"
        msgs = [{"role": "user", "content": ASKS[0]}]
        call = client.chat.completions.create(messages=msgs, **ask).choices[0].message.tool_calls[0]
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})}]
        final = client.chat.completions.create(messages=msgs, **ask).choices[0]
        print("second turn:", final.finish_reason, repr((final.message.content or "")[:120]),
              [(t.function.name, t.function.arguments) for t in final.message.tool_calls or []])
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        @tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            return "sunny"

        llm = ChatOpenAI(base_url=base + "/v1", api_key="x", model="x", temperature=0, max_tokens=96)
        print("langchain bind_tools:", llm.bind_tools([get_weather]).invoke(ASKS[0]).tool_calls)
        print(f"tool_calls with auto: {whole} of {len(ASKS)} whole, {streamed} of {len(ASKS)} streamed")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
