"""`via-edge serve` on loopback, driven by the official openai client."""

import concurrent.futures
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import EXACT  # noqa: F401  (the server below runs the exact flags)

PROMPTS = [f"prompt number {i}: tell me about {w}" for i, w in
           enumerate(["cats", "dogs", "rain", "code", "tea", "maps", "jazz", "snow"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "via_edge", "serve", "--port", str(port), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server(tiny_target):
    proc, base = start(["--target", tiny_target, "--draft-layers", "0-1", "--slim-layers", "0-2", "--mode", "sd",
                        "--exact", "--no-flash-attn", "--kv-type", "f32", "--ctx", "512", "--max-tokens-limit", "256",
                        "--max-body", "20000"])
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def model_id(client):
    return client.models.list().data[0].id


def test_models_and_health(client, server):
    assert model_id(client) == "target"
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model=model_id(client), messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
              temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    timings = full.model_extra["timings"]
    assert timings["draft_n"] >= timings["draft_n_accepted"] and timings["mode"] == "sd"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].message.content


def test_completions_and_modes(client):
    ar = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0,
                                   extra_body={"mode": "ar"})
    sd = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0)
    assert ar.choices[0].text == sd.choices[0].text and ar.usage.completion_tokens > 0
    pieces = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0,
                                       stream=True)
    assert "".join(p.choices[0].text for p in pieces) == sd.choices[0].text


def test_concurrent_requests_match_alone(client):
    def ask(p):
        r = client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": p}],
                                           max_tokens=16, temperature=0)
        return r.choices[0].message.content

    alone = [ask(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == alone


def test_bad_requests_are_clean_4xx(client, server):
    def post(body, headers=None):
        return httpx.post(server + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json", **(headers or {})}, timeout=30)

    r = post(b'{"messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-99", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        client.completions.create(model=model_id(client), prompt="x", max_tokens=100000)
    r = post(b'{"messages": [{"role": "user", "content": "' + b"a" * 30000 + b'"}]}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = post(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}')
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    # still serving
    ok = client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None


def test_closing_the_connection_cancels(smollm2):
    proc, base = start(["--target", smollm2, "--mode", "ar", "--ctx", "4096"])
    try:
        body = {"model": "via-edge", "prompt": "Count from one to one thousand:", "max_tokens": 3000,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                break  # one chunk, then hang up
        deadline = time.time() + 10  # 3000 tokens would take far longer than this
        while httpx.get(base + "/health").json()["cancelled"] < 1:
            assert time.time() < deadline, "generation was not cancelled"
            time.sleep(0.1)
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
