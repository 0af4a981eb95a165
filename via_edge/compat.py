"""llama-cpp-python / OpenAI response shapes on top of `Engine`, so existing code can switch by
changing one import. Responses also carry llama-server style `timings` with the speculative
statistics (`draft_n`, `draft_n_accepted`, tier counts).
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping, Sequence

from .engine import Engine, Result, Stream
from .errors import InvalidParameterError

# llama-cpp-python's create_completion defaults, so a switched program behaves the same
DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)


def timings(result: Result, digits: int = 3) -> dict:
    """llama-server's `timings` object, with the speculative counters and tier counts."""
    s = result.stats
    return {
        "queued_ms": round(s.queue_seconds * 1e3, digits),
        "cache_n": s.cache_tokens, "prompt_n": s.prompt_tokens, "prompt_ms": round(s.prefill_seconds * 1e3, digits),
        "prompt_per_second": round(s.prompt_tokens_per_second, digits),
        "predicted_n": s.generated_tokens, "predicted_ms": round(s.generate_seconds * 1e3, digits),
        "predicted_per_second": round(s.tokens_per_second, digits),
        "draft_n": s.draft_n, "draft_n_accepted": s.draft_n_accepted, "copied_n": s.copied_tokens,
        "mean_accepted_per_round": round(s.mean_accepted_per_round, digits),
        "mean_draft_length": round(s.mean_draft_length, digits),
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
        if key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "mode", "spec", "should_stop",
                   "arrived"):
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


class _Shape:
    """The fields one kind of response shares, and how its text sits in a choice."""

    def __init__(self, engine: Engine, kind: str, prefix: str) -> None:
        self.base = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                     "model": engine.model_name}
        self.chat = prefix == "chatcmpl"

    def choice(self, text: str | None, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        if delta:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def whole(self, res: Result) -> dict:
        return {**self.base, "choices": [self.choice(res.text, res.finish_reason, False)],
                "usage": usage(res), "timings": timings(res)}

    def chunks(self, stream: Stream) -> Iterator[dict]:
        if self.chat:
            yield {**self.base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                             "finish_reason": None}]}
        for piece in stream:
            yield {**self.base, "choices": [self.choice(piece.text, None, True)]}
        res = stream.result
        yield {**self.base, "choices": [self.choice(None, res.finish_reason, True)], "usage": usage(res),
               "timings": timings(res)}


def respond(engine: Engine, tokens: Sequence[int], kind: str, stream: bool = False, **kwargs) -> dict | Iterator[dict]:
    """A completion ("completion") or chat completion ("chat") of prompt tokens, whole or in chunks."""
    if kind == "chat":
        shape = _Shape(engine, "chat.completion.chunk" if stream else "chat.completion", "chatcmpl")
    else:
        shape = _Shape(engine, "text_completion", "cmpl")
    pieces = engine.stream(list(tokens), **_params(kwargs))
    if stream:
        return shape.chunks(pieces)
    for _ in pieces:
        pass
    return shape.whole(pieces.result)


def create_completion(engine: Engine, prompt: str | Sequence[int], *, stream: bool = False,
                      **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_completion` on an engine (a dict, or chunks with stream=True)."""
    return respond(engine, engine.tokens_for(prompt, chat_template=False), "completion", stream, **kwargs)


def create_chat_completion(engine: Engine, messages: Sequence[Mapping[str, str]], *, stream: bool = False,
                           **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_chat_completion` on an engine."""
    return respond(engine, engine.chat_prompt(messages), "chat", stream, **kwargs)


class Llama:
    """llama-cpp-python's `Llama` calls on a via-edge engine: code written for it switches by
    changing its import and constructor.

        from via_edge.compat import Llama
        llm = Llama.from_pair("qwen2.5-coder", mode="sd")   # was: Llama(model_path=...)
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Llama":
        return cls(Engine.from_pair(name, **kwargs))

    def create_completion(self, prompt: str | Sequence[int], **kwargs) -> dict | Iterator[dict]:
        return create_completion(self.engine, prompt, **kwargs)

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], **kwargs) -> dict | Iterator[dict]:
        return create_chat_completion(self.engine, messages, **kwargs)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
