"""llama-cpp-python / OpenAI response shapes on top of `Engine`, so existing code can switch by
changing one import. Responses also carry llama-server style `timings` with the speculative
statistics (`draft_n`, `draft_n_accepted`, tier counts).
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping, Sequence

from .engine import Engine, Result
from .errors import InvalidParameterError

# llama-cpp-python's create_completion defaults, so a switched program behaves the same
DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)


def timings(result: Result) -> dict:
    s = result.stats
    return {
        "prompt_n": s.prompt_tokens, "prompt_ms": round(s.prefill_seconds * 1e3, 3),
        "prompt_per_second": round(s.prompt_tokens_per_second, 3),
        "predicted_n": s.generated_tokens, "predicted_ms": round(s.generate_seconds * 1e3, 3),
        "predicted_per_second": round(s.tokens_per_second, 3),
        "draft_n": s.draft_n, "draft_n_accepted": s.draft_n_accepted,
        "tier_a": s.tier_a, "tier_b": s.tier_b, "tier_c": s.tier_c, "mode": result.mode,
    }


def usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens)}


def _params(kwargs: dict) -> dict:
    """Map OpenAI/llama-cpp-python argument names onto Engine.stream's, rejecting unknown ones."""
    out = {k: v for k, v in DEFAULTS.items()}
    for key, value in kwargs.items():
        if value is None:
            continue
        if key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "mode", "spec", "should_stop"):
            out[key] = value
        elif key == "stop":
            out["stop"] = [value] if isinstance(value, str) else list(value)
        elif key in ("stream", "model", "n", "user", "logprobs", "echo", "frequency_penalty",
                     "presence_penalty", "repeat_penalty"):
            continue  # shape-only or unsupported-but-harmless knobs
        else:
            raise InvalidParameterError(f"unknown parameter '{key}'")
    if out["max_tokens"] is not None and out["max_tokens"] < 1:
        raise InvalidParameterError(f"max_tokens must be >= 1, got {out['max_tokens']}")
    return out


def create_completion(engine: Engine, prompt: str | Sequence[int], *, stream: bool = False, **kwargs):
    params = _params(kwargs)
    cid, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), engine.model_name
    pieces = engine.stream(prompt, chat_template=False, **params)
    if stream:
        return _completion_chunks(engine, pieces, cid, created, model)
    for _ in pieces:
        pass
    res = engine.last_result
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": res.text, "index": 0, "logprobs": None, "finish_reason": res.finish_reason}],
            "usage": usage(res), "timings": timings(res)}


def _completion_chunks(engine, pieces, cid, created, model) -> Iterator[dict]:
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    for piece in pieces:
        yield {**base, "choices": [{"text": piece.text, "index": 0, "logprobs": None, "finish_reason": None}]}
    res = engine.last_result
    yield {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": res.finish_reason}],
           "usage": usage(res), "timings": timings(res)}


def create_chat_completion(engine: Engine, messages: Sequence[Mapping[str, str]], *, stream: bool = False,
                           **kwargs):
    params = _params(kwargs)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), engine.model_name
    pieces = engine.stream(engine.chat_prompt(messages), **params)
    if stream:
        return _chat_chunks(engine, pieces, cid, created, model)
    for _ in pieces:
        pass
    res = engine.last_result
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text}, "logprobs": None,
                         "finish_reason": res.finish_reason}],
            "usage": usage(res), "timings": timings(res)}


def _chat_chunks(engine, pieces, cid, created, model) -> Iterator[dict]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}]}
    for piece in pieces:
        yield {**base, "choices": [{"index": 0, "delta": {"content": piece.text}, "logprobs": None,
                                    "finish_reason": None}]}
    res = engine.last_result
    yield {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": res.finish_reason}],
           "usage": usage(res), "timings": timings(res)}
