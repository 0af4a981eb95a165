"""`via-edge serve` on loopback, driven by the official openai client."""

import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import EXACT  # noqa: F401  (the server below runs the exact flags)
from via_edge import Engine

# a streamed completion that runs far longer than any test waits for it
ENDLESS = {"prompt": "Count from one to one thousand:", "max_tokens": 3000, "stream": True, "temperature": 0}
PROMPTS = [f"prompt number {i}: tell me about {w}" for i, w in
           enumerate(["cats", "dogs", "rain", "code", "tea", "maps", "jazz", "snow"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, ready, what: str, timeout: float = 60) -> subprocess.Popen:
    """`python -m via_edge ARGS` in a process of its own, once `ready()` is true (a crash at start
    raises with its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "via_edge", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())
        if ready():
            return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def start(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(base + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return launch(["serve", "--port", port, *args], healthy, "the server"), base


@contextlib.contextmanager
def serving(args):
    """A server for the block's duration: its base URL."""
    proc, base = start(args)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(tiny_target):
    with serving(["--target", tiny_target, "--draft-layers", "0-1", "--slim-layers", "0-2", "--mode", "sd",
                  "--exact", "--no-flash-attn", "--kv-type", "f32", "--ctx", "2048", "--parallel", "4",
                  "--max-tokens-limit", "256", "--max-body", "20000"]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def model_id(client):
    return client.models.list().data[0].id


def test_models_and_health(client, server):
    assert model_id(client) == "target"
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["weights"] == "F32"  # the tiny target's own type
    # --ctx is the total, split over the slots as llama-server splits it
    assert (health["parallel"], health["n_ctx_total"], health["n_ctx_slot"]) == (4, 2048, 512)
    assert client.models.list().data[0].model_extra["meta"]["n_ctx_slot"] == 512


def test_erasing_the_slots_forgets_cached_prompts(client, server):
    """The second identical request finds its prompt in a slot's cache (llama-server's cache_n);
    after POST /slots?action=erase it is prefilled again."""
    kw = dict(model=model_id(client), prompt="the same prompt again", max_tokens=2, temperature=0)
    first = client.completions.create(**kw).model_extra["timings"]
    again = client.completions.create(**kw).model_extra["timings"]
    assert httpx.post(server + "/slots", params={"action": "erase"}).json() == {"erased": 4}
    cold = client.completions.create(**kw).model_extra["timings"]
    assert again["cache_n"] == again["prompt_n"] - 1 > 0 and cold["cache_n"] == 0
    assert first["prompt_n"] == again["prompt_n"] == cold["prompt_n"]
    assert httpx.post(server + "/slots", params={"action": "drop"}).status_code == 400


def test_chat_streaming_equals_non_streaming(client, tiny_target):
    kw = dict(model=model_id(client), messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
              temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    timings = full.model_extra["timings"]
    # the same request on an engine in this process (same exact kernels) is the oracle for the counters
    with Engine(tiny_target, draft_layers="0-1", mode="sd", n_ctx=512, kv_type="f32", flash_attn=False,
                use_extra_bufts=False) as engine:
        ref = engine.chat([{"role": "user", "content": "hello there"}], max_tokens=24)
    assert full.choices[0].message.content == ref.text and timings["mode"] == "sd"
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (ref.stats.draft_n, ref.stats.draft_n_accepted)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].message.content


def test_a_prediction_leaves_a_completion_as_it_was(client):
    """A prediction that shares nothing with the answer (a `ar` request: copy drafting on for it)
    changes no token, and usage counts all its tokens as rejected."""
    done = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0)
    assert done.usage.completion_tokens_details is None  # no prediction: llama-cpp-python's usage
    again = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0,
                                      extra_body={"mode": "ar", "prediction": {"type": "content", "content": "zzz"}})
    assert again.choices[0].text == done.choices[0].text
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens > 0


def test_completions_and_modes(client):
    ar = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0,
                                   extra_body={"mode": "ar"})
    sd = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0)
    assert ar.choices[0].text == sd.choices[0].text and ar.usage.completion_tokens > 0
    pieces = client.completions.create(model=model_id(client), prompt="the cat", max_tokens=20, temperature=0,
                                       stream=True)
    assert "".join(p.choices[0].text for p in pieces) == sd.choices[0].text


def test_concurrent_requests_match_alone(client):
    """Eight different prompts at once on four slots (batched decodes, four queued): each answer is
    that prompt's answer sent alone, and the queued ones say they waited."""
    def ask(p):
        r = client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": p}],
                                           max_tokens=16, temperature=0)
        return r.choices[0].message.content, r.model_extra["timings"]["queued_ms"]

    alone = [ask(p)[0] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert [t for t, _ in together] == alone
    assert max(q for _, q in together) > 0


def test_cancel_frees_the_slot_and_a_full_queue_gets_503(smollm2):
    """Two slots, a queue of one: two endless streams hold the slots, a third request queues, a
    fourth gets an OpenAI-shaped 503 at once. Hanging up one stream frees its slot for the queued
    request, while the other stream keeps going; then the server serves as before."""
    with serving(["--target", smollm2, "--mode", "ar", "--parallel", "2", "--max-queue", "1"]) as base:
        with httpx.Client(timeout=120) as http, contextlib.ExitStack() as stack:
            a = stack.enter_context(http.stream("POST", base + "/v1/completions", json=ENDLESS))
            b = stack.enter_context(http.stream("POST", base + "/v1/completions", json=ENDLESS))
            a_lines, b_lines = a.iter_lines(), b.iter_lines()
            next(a_lines), next(b_lines)  # both generating: the two slots are taken
            queued = concurrent.futures.ThreadPoolExecutor(1).submit(
                httpx.post, base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
            deadline = time.time() + 30
            while httpx.get(base + "/health").json()["queued"] < 1:
                assert time.time() < deadline, "the third request never queued"
                time.sleep(0.05)
            busy = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "server_busy" and busy.json()["error"]["type"] == "server_error"
            assert not queued.done()
            a.close()  # hang up: the slot goes to the queued request
            done = queued.result(timeout=60)
            assert done.status_code == 200 and done.json()["timings"]["queued_ms"] > 0
            more = [next(b_lines) for _ in range(5)]  # the other stream was not disturbed
            assert all(line.startswith("data: {") or line == "" for line in more)
        health = httpx.get(base + "/health").json()
        assert health["cancelled"] >= 1
        ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200


def test_bad_requests_are_clean_4xx(client, server):
    def post(body, headers=None):
        return httpx.post(server + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json", **(headers or {})}, timeout=30)

    r = post(b'{"messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # any model name is the loaded model's, as llama-server takes it (clients send their own names)
    named = client.chat.completions.create(model="gpt-99", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert named.model == model_id(client)
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
    with serving(["--target", smollm2, "--mode", "ar", "--ctx", "4096"]) as base:
        body = {"model": "via-edge", **ENDLESS}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                break  # one chunk, then hang up
        deadline = time.time() + 10  # 3000 tokens would take far longer than this
        while httpx.get(base + "/health").json()["cancelled"] < 1:
            assert time.time() < deadline, "generation was not cancelled"
            time.sleep(0.1)
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "mode": "fast"}, "mode"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages.0.content.1.type"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_wrong_types_are_400_naming_the_field(server, body, field, stream):
    r = httpx.post(server + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [[5, 10 ** 6], [5, 2 ** 40], [5, "x"], [5, 1.5], [-1], []])
def test_token_id_prompts_are_checked_against_the_vocabulary(server, prompt):
    r = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ok = httpx.post(server + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3


def test_chunked_body_is_cut_off_at_the_limit(server):
    """No Content-Length: the limit applies while the body streams in. The client sends 30 KB of
    an announced-endless chunked body and then waits: a server that read bodies whole would wait
    too; this one answers 413 as soon as it has more than the 20,000-byte limit."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(30):
            s.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
        reply = b""
        while b"}}" not in reply and (part := s.recv(65536)):
            reply += part
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply
    ok = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_overlong_prompt_is_400_streaming_or_not(server):
    for stream in (False, True):
        # 700 tokens fit the 2048-token context but not one slot's 512
        r = httpx.post(server + "/v1/completions", json={"prompt": "word " * 700, "stream": stream}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "512 per slot" in r.json()["error"]["message"]


def test_busy_port_fails_before_loading(tiny_target):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "via_edge", "serve", "--port", str(port),
                               "--target", str(tiny_target)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in proc.stderr and "serving" not in proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr and time.time() - t0 < 30


def test_a_burst_fills_the_slots_and_exactly_max_queue_more(smollm2):
    """One slot, --max-queue 2, five streams opened at once: one generates, two queue (a stream's
    200 goes out when it gets its slot), two get a 503 at once saying 2 are queued. A stream that
    hangs up passes its slot to the next in the queue, until the counts are back to zero."""
    import queue as queue_mod

    with serving(["--target", smollm2, "--mode", "ar", "--parallel", "1", "--max-queue", "2"]) as base:
        got: queue_mod.Queue = queue_mod.Queue()
        hang_up = threading.Event()
        together = threading.Barrier(5)

        def open_one(_i) -> None:
            together.wait()
            with httpx.stream("POST", base + "/v1/completions", json=ENDLESS, timeout=120) as r:
                got.put((r.status_code, r.read().decode() if r.status_code == 503 else ""))
                if r.status_code == 200:
                    hang_up.wait(60)

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(open_one, i) for i in range(5)]
            first = [got.get(timeout=60) for _ in range(3)]
            assert sorted(code for code, _ in first) == [200, 503, 503]
            refused = next(body for code, body in first if code == 503)
            assert "2 requests are queued (--max-queue 2)" in json.loads(refused)["error"]["message"]
            health = httpx.get(base + "/health").json()
            assert (health["slots_busy"], health["queued"]) == (1, 2)
            hang_up.set()  # each stream that gets its slot now hangs up at once
            rest = [got.get(timeout=60) for _ in range(2)]
            assert [code for code, _ in rest] == [200, 200]
            for f in futures:
                f.result(timeout=60)
        deadline = time.time() + 30
        while (h := httpx.get(base + "/health").json())["queued"] or h["slots_busy"]:
            assert time.time() < deadline, f"the count did not come back to zero: {h}"
            time.sleep(0.1)
        ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200


def test_a_grammar_that_does_not_parse_says_why_in_the_400(client):
    with pytest.raises(openai.BadRequestError, match="Undefined rule identifier 'word'"):
        client.completions.create(model=model_id(client), prompt="x", max_tokens=2,
                                  extra_body={"grammar": "root ::= word"})


def test_a_lone_surrogate_is_an_openai_400(server):
    body = b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "surrogate" in err["message"]


def test_stream_usage_comes_in_its_own_last_chunk(client):
    """OpenAI sends usage, when asked with stream_options, in a final chunk with no choices; the
    SDK reads it there. Without the option no chunk carries usage."""
    kw = dict(model=model_id(client), messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
              stream=True)
    chunks = list(client.chat.completions.create(**kw, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    plain = list(client.chat.completions.create(**kw))
    assert all(c.usage is None for c in plain) and plain[-1].choices
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(**{**kw, "stream": False}, stream_options={"include_usage": True})


@pytest.mark.slow
def test_sigterm_answers_running_streams_and_turns_the_queue_away(smollm2):
    """After SIGTERM a running generation may finish for --drain seconds; at the deadline it is
    stopped and still answered in full (a final chunk with finish_reason, then [DONE]); requests
    waiting for a slot get a 503 at once, streamed or not; uvicorn cancels nothing."""

    proc, base = start(["--target", smollm2, "--mode", "ar", "--parallel", "1", "--drain", "2", "--max-queue", "4"])
    queued: dict[str, httpx.Response] = {}

    def wait_in_queue(name: str, body: dict) -> None:
        queued[name] = httpx.post(base + "/v1/completions", json=body, timeout=60)

    with httpx.stream("POST", base + "/v1/completions", json=ENDLESS, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        waiters = [threading.Thread(target=wait_in_queue, args=(name, body)) for name, body in
                   (("plain", {**ENDLESS, "stream": False}), ("stream", ENDLESS))]
        for w in waiters:
            w.start()
        deadline = time.time() + 10
        while httpx.get(base + "/health").json()["queued"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        t0 = time.time()
        proc.terminate()
        events = [line for line in lines if line.startswith("data: ")]
    waited = time.time() - t0
    for w in waiters:
        w.join(30)
    rc = proc.wait(30)
    err = proc.stderr.read()
    assert rc in (0, -signal.SIGTERM), (rc, err)
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length" and 1.5 < waited < 10, (last, waited)
    for name in ("plain", "stream"):
        assert queued[name].status_code == 503, (name, queued[name].text)
        assert queued[name].json()["error"]["code"] == "shutting_down"
    assert "2 queued requests get a 503" in err and "Cancel" not in err and "ERROR" not in err, err


def test_api_keys_guard_every_route_but_health_and_unknown_routes_are_openai_shaped(tiny_target):
    """In this process, through the app itself: 401 without a key this server was given, /health
    open (load balancers probe it), and 404/405 in OpenAI's error shape as every other refusal."""
    from fastapi.testclient import TestClient

    from via_edge.server.app import create_app

    with Engine(tiny_target, mode="ar", n_ctx=512) as engine, \
            TestClient(create_app(engine, api_keys=("k-one", "k-two"))) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401
        ok = {"Authorization": "Bearer k-two"}
        assert http.get("/v1/models", headers=ok).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=ok).status_code == 200
        missing = http.get("/v1/nothing", headers=ok)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong = http.get("/v1/chat/completions", headers=ok)
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in wrong.headers["allow"]


def test_long_prompts_on_the_prefill_helper_under_slots_answer_as_without_it(client, tiny_target):
    """`serve --prefill-helper` with four slots says so when ready; two long chat requests at once
    (their prompts decoded on the copy in turn) get the answers the server without it gives."""
    messages = [[{"role": "user", "content": " ".join(f"w{(i * k) % 97}" for i in range(60))}] for k in (3, 7)]

    def ask(c, m):
        return c.chat.completions.create(model=model_id(c), messages=m, max_tokens=16, temperature=0,
                                         extra_body={"mode": "ar"}).choices[0].message.content

    want = [ask(client, m) for m in messages]
    proc, base = start(["--target", tiny_target, "--mode", "ar", "--exact", "--no-flash-attn", "--kv-type", "f32",
                        "--ctx", "2048", "--parallel", "4", "--prefill-helper"])
    try:
        helped = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda m: ask(helped, m), messages)) == want
        usage = helped.chat.completions.create(model=model_id(helped), messages=messages[0], max_tokens=1)
        assert usage.usage.prompt_tokens >= 64  # long enough for the copy
    finally:
        proc.terminate()
        proc.wait(10)
    assert "4 slots of 512 tokens, prefill helper) on http://" in proc.stderr.read()


def test_serving_beyond_loopback_without_a_key_warns(tiny_target):
    proc, base = start(["--target", tiny_target, "--host", "0.0.0.0", "--ctx", "512", "--parallel", "1"])
    proc.terminate()
    proc.wait(10)
    assert "without --api-key" in proc.stderr.read()
