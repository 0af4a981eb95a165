"""Fill-in-the-middle: the prompt layout (llama-server's for /infill, llama-cpp-python's for
`suffix`), refusals for models without FIM tokens, and both endpoints live."""

import json

import httpx
import pytest
from conftest import EXACT
from test_server import serving

from via_edge import Engine
from via_edge.errors import InvalidParameterError
from via_edge.openai_api.infill import FILE, REPO, as_llama_server, infill_tokens

PREFIX = "def area(r):\n    return "
SUFFIX = " * r * r\n\nprint(area(2))\n"


@pytest.fixture(scope="module")
def tiny_fim(tiny_dir):
    from make_tiny_gguf import make_tiny_gguf

    return make_tiny_gguf(tiny_dir / "fim.gguf", arch="qwen2", blocks=2, seed=5, fim=True, context_length=4096)


@pytest.fixture(scope="module")
def fim_engine(tiny_fim):
    with Engine(tiny_fim, mode="lookup", **{**EXACT, "n_ctx": 4096}) as engine:
        yield engine


def test_the_model_s_fim_tokens_are_read(fim_engine, tiny_target):
    names = {k: fim_engine.target.token_text(t) for k, t in fim_engine.target.fim.items()}
    assert names == {"pre": b"<|fim_prefix|>", "suf": b"<|fim_suffix|>", "mid": b"<|fim_middle|>",
                     "rep": b"<|repo_name|>", "sep": b"<|file_sep|>"}
    with Engine(tiny_target, **EXACT) as plain:
        assert plain.target.fim == {}
        with pytest.raises(InvalidParameterError, match="fill-in-the-middle") as exc:
            infill_tokens(plain.target, PREFIX, SUFFIX, field="suffix")
        assert exc.value.param == "suffix"


def test_suffix_is_llama_cpp_python_s_layout_and_infill_is_llama_server_s(fim_engine):
    m = fim_engine.target
    fim = m.fim

    def tok(text):
        return m.tokenize(text, add_special=False, parse_special=False)

    assert infill_tokens(m, PREFIX, SUFFIX) == [fim["pre"]] + tok(PREFIX) + [fim["suf"]] + tok(SUFFIX) + [fim["mid"]]
    extra = [("util.py", "def helper():\n    pass\n"), ("b.py", "X = 1\n")]
    got = infill_tokens(m, PREFIX, SUFFIX, extra, prompt="3.14", n_predict=64)
    want = ([fim["rep"]] + tok(REPO) + [fim["sep"]] + tok("util.py\n") + tok(extra[0][1]) + [fim["sep"]]
            + tok("b.py\n") + tok(extra[1][1]) + [fim["sep"]] + tok(FILE)
            + [fim["pre"]] + tok(PREFIX) + tok("3.14") + [fim["suf"]] + tok(SUFFIX) + [fim["mid"]])
    assert got == want
    # budgets: the prefix keeps its end (3/4 of a 2048 batch), the suffix its start (1/4, less the typed
    # middle and two), the extra chunks what the context leaves (4096 - 2048 - 2 x 64), oldest cut first
    long_pre, long_suf = "x = 1\n" * 2000, "y = 2\n" * 2000
    big = [("big.py", "z = 3\n" * 3000)]
    got = infill_tokens(m, long_pre, long_suf, big, n_predict=64)
    pre, suf = tok(long_pre)[-1536:], tok(long_suf)[:510]
    body = [fim["pre"]] + pre + [fim["suf"]] + suf + [fim["mid"]]
    assert got[-len(body):] == body and len(got) - len(body) == 4096 - 2048 - 128


def test_llama_server_shape():
    chunk = {"model": "m", "choices": [{"text": "ab", "finish_reason": None}]}
    assert as_llama_server(chunk) == {"content": "ab", "stop": False, "model": "m"}
    last = {"model": "m", "choices": [{"text": "", "finish_reason": "length"}],
            "timings": {"predicted_n": 4, "prompt_n": 9, "cache_n": 0}}
    out = as_llama_server(last)
    assert out["stop"] and out["stop_type"] == "limit" and out["tokens_predicted"] == 4 and out["timings"]
    assert as_llama_server({"model": "m", "choices": []}) is None  # the usage chunk


def test_infill_and_suffix_live(tiny_fim, tiny_target, fim_engine):
    """/infill as llama.vim sends it, streamed and not, and `suffix` on /v1/completions: greedy,
    the answer is the engine's own on the same prompt tokens; a model without FIM tokens is a 400."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "", "n_predict": 12,
            "input_extra": [{"filename": "util.py", "text": "PI = 3.14159\n"}], "cache_prompt": True,
            "samplers": ["top_k", "top_p", "infill"], "t_max_predict_ms": 500, "top_k": 40, "top_p": 0.9}
    want = fim_engine.generate(infill_tokens(fim_engine.target, PREFIX, SUFFIX, [("util.py", "PI = 3.14159\n")],
                                             n_predict=12), max_tokens=12)
    plain = fim_engine.generate(infill_tokens(fim_engine.target, PREFIX, SUFFIX), max_tokens=12)
    with serving(["--target", tiny_fim, "--exact", "--no-flash-attn", "--kv-type", "f32", "--ctx", "4096",
                  "--parallel", "1"]) as base:
        r = httpx.post(base + "/infill", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["content"] == want.text and out["stop"] is True
        assert out["tokens_predicted"] == len(want.tokens) - want.eog and out["timings"]["prompt_n"] > 0
        with httpx.stream("POST", base + "/infill", json=body | {"stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert "".join(e["content"] for e in events) == want.text
        assert events[-1]["stop"] and not any(e["stop"] for e in events[:-1]) and "timings" in events[-1]
        c = httpx.post(base + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12,
                                                       "temperature": 0}, timeout=60)
        assert c.status_code == 200 and c.json()["choices"][0]["text"] == plain.text
        bad = httpx.post(base + "/infill", json=body | {"input_extra": [{"name": "x"}]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_extra"
    with serving(["--target", tiny_target, "--ctx", "1024", "--parallel", "1"]) as base:
        for path, req, field in (("/infill", body, "input_suffix"),
                                 ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX}, "suffix")):
            r = httpx.post(base + path, json=req, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "fill-in-the-middle" in r.json()["error"]["message"]
