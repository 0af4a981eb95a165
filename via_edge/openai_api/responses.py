"""OpenAI's request arguments into `Engine.request`'s, and results into OpenAI's response shapes.

Completions, chat completions and their streamed chunks, as the OpenAI API and llama-cpp-python
return them, with llama-server style `timings` carrying the speculative statistics (`draft_n`,
`draft_n_accepted`, tier counts). The server and `compat.Llama` both answer through here.
"""

from __future__ import annotations

import inspect
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..decode.scores import TokenLogprobs
from ..engine import MAX_LOGPROBS, Engine, Request
from ..errors import InvalidParameterError
from ..results import Result, Stream, drain
from .callparse import CallStream, parse_calls
from .infill import infill_tokens
from .toolcalls import Tools, constrain

# llama-cpp-python's create_completion defaults, so a switched program behaves the same
DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
CHAT_TEMPERATURE = 0.2  # its create_chat_completion's default


def timings(result: Result, digits: int = 3) -> dict:
    """llama-server's `timings` object, with the speculative counters and tier counts. Its
    `predicted_per_second` counts as llama-server's does, the tokens decoded in the span from the
    first to the last (the first comes with the prompt's decode, except under `--parallel` slots,
    where the first round decodes it), so the two servers' figures compare alike;
    `tokens_per_second` elsewhere counts every token (docs/benchmarks.md section 59)."""
    s = result.stats
    steps = max(s.generated_tokens - s.first_from_prompt, 0)
    return {
        "queued_ms": round(s.queue_seconds * 1e3, digits),
        "cache_n": s.cache_tokens, "prompt_n": s.prompt_tokens, "prompt_ms": round(s.prefill_seconds * 1e3, digits),
        "prompt_per_second": round(s.prompt_tokens_per_second, digits), "prompt_helped_n": s.target.helped,
        "predicted_n": s.generated_tokens, "predicted_ms": round(s.generate_seconds * 1e3, digits),
        "predicted_per_second": round(steps / s.generate_seconds if s.generate_seconds else 0.0, digits),
        "draft_n": s.draft_n, "draft_n_accepted": s.draft_n_accepted, "copied_n": s.copied_tokens,
        "prediction_draft_n": s.prediction_draft_n, "prediction_draft_n_accepted": s.prediction_draft_n_accepted,
        "memory_draft_n": s.memory_draft_n, "memory_draft_n_accepted": s.memory_draft_n_accepted,
        "mean_accepted_per_round": round(s.mean_accepted_per_round, digits),
        "mean_draft_length": round(s.mean_draft_length, digits),
        "tier_a": s.tier_a, "tier_b": s.tier_b, "tier_c": s.tier_c, "mode": result.mode,
    }


def usage(result: Result) -> dict:
    """OpenAI's usage; `completion_tokens_details` counts a prediction's tokens that appear in the
    answer (accepted) and those that do not (rejected), as its Predicted Outputs do."""
    s = result.stats
    out = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
           "total_tokens": result.prompt_tokens + result.completion_tokens}
    if s.prediction_accepted + s.prediction_rejected:  # a request with a prediction (llama-cpp-python's shape else)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": s.prediction_accepted,
                                            "rejected_prediction_tokens": s.prediction_rejected}
    return out


# arguments llama-cpp-python takes that change nothing here at these values (its defaults); any
# other value is refused by name rather than silently ignored
NEUTRAL = dict(suffix=None, echo=False, typical_p=1.0, tfs_z=1.0, mirostat_mode=0, mirostat_tau=5.0,
               mirostat_eta=0.1, stopping_criteria=None, logits_processor=None, tools=None, tool_choice=None,
               functions=None, function_call=None, n=1, best_of=1)
# what Engine.request takes under the same name: its signature is the one list of generation fields
# (the prompt and how it is tokenized are the caller's; the rest are mapped below)
MAPPED = ("grammar", "response_format", "logprobs", "prediction")
PASSED = tuple(p for p in inspect.signature(Engine.request).parameters
               if p not in ("self", "prompt", "chat_template", *MAPPED))
SHAPE_ONLY = ("stream", "model", "user")


def engine_kwargs(kwargs: Mapping[str, Any], kind: str = "completion") -> dict:
    """Map OpenAI/llama-cpp-python argument names of a "completion" or "chat" request onto
    Engine.request's; what via-edge does not do is refused by name (ValueError), never ignored.
    The values themselves are Engine.request's to check."""
    out = {k: v for k, v in DEFAULTS.items()}
    for key, value in kwargs.items():
        if value is None or key in SHAPE_ONLY or key in ("logprobs", "top_logprobs"):
            continue
        if key in PASSED:
            out[key] = value
        elif key == "grammar":  # GBNF text, or llama-cpp-python's LlamaGrammar
            out["grammar"] = getattr(value, "_grammar", value)
        elif key == "prediction":
            out["prediction"] = prediction_text(value)
        elif key == "response_format":
            if not isinstance(value, Mapping):
                raise InvalidParameterError("'response_format' must be an object", "response_format")
            out["response_format"] = value
        elif key in NEUTRAL:
            if value != NEUTRAL[key]:
                raise InvalidParameterError(f"'{key}' is not supported by via-edge (got {value!r:.60})", key)
        else:
            raise InvalidParameterError(f"unknown parameter '{key}'", key)
    out["logprobs"] = _logprobs(kwargs.get("logprobs"), kwargs.get("top_logprobs"), kind)
    return out


def prediction_text(value: Any) -> str:
    """The text of OpenAI's `prediction`: {"type": "content", "content": a string or a list of
    text parts}. Unlike OpenAI, any other field may come with it: the answer does not change."""
    if not isinstance(value, Mapping):
        raise InvalidParameterError("'prediction' must be an object: {\"type\": \"content\", \"content\": ...}",
                                    "prediction")
    if value.get("type") != "content":
        raise InvalidParameterError(f"'prediction.type' must be 'content', got {value.get('type')!r:.40}",
                                    "prediction.type")
    content = value.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidParameterError("'prediction.content' must be a string or a list of {\"type\": \"text\", "
                                "\"text\": ...} parts", "prediction.content")


def _logprobs(logprobs, top_logprobs, kind: str) -> int | None:
    """How many alternatives per token, or None: chat takes `logprobs: true` and `top_logprobs`
    (0..20), completions an integer `logprobs`, as OpenAI does."""
    def count(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise InvalidParameterError(f"'{name}' must be an integer in 0..{MAX_LOGPROBS}, got {value!r:.40}", name)
        return value

    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise InvalidParameterError(f"'logprobs' must be true or false for chat, got {logprobs!r:.40}", "logprobs")
        if top_logprobs is not None and not logprobs:
            raise InvalidParameterError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (count("top_logprobs", top_logprobs) if top_logprobs is not None else 0) if logprobs else None
    if top_logprobs is not None:
        raise InvalidParameterError("'top_logprobs' is for chat; completions take an integer 'logprobs'",
                                    "top_logprobs")
    return None if logprobs is None else count("logprobs", logprobs)


class _Shape:
    """The fields one kind of response shares, and how its text and logprobs sit in a choice."""

    def __init__(self, engine: Engine, kind: str, prefix: str, logprobs: bool, tools: Tools | None = None) -> None:
        self.base = {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                     "model": engine.model_name}
        self.chat = prefix == "chatcmpl"
        self.target, self.with_logprobs, self.tools = engine.target, logprobs, tools
        self.offset = 0  # characters of text before the next token (completions' text_offset)

    def choice(self, text: str | None, finish: str | None, delta: bool,
               lps: Sequence[TokenLogprobs] = ()) -> dict:
        logprobs = self.logprobs(lps, text or "") if self.with_logprobs and (lps or not delta) else None
        if not self.chat:
            return {"text": text or "", "index": 0, "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, lps: Sequence[TokenLogprobs], text: str) -> dict:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or the completions'
        parallel lists (with each token's offset in the text)."""
        def piece(token: int) -> tuple[str, bytes]:
            raw = self.target.token_bytes(token)
            return raw.decode("utf-8", "replace"), raw

        if self.chat:
            content = []
            for token, lp, top in lps:
                s, raw = piece(token)
                content.append({"token": s, "logprob": lp, "bytes": list(raw), "top_logprobs": [
                    {"token": piece(t)[0], "logprob": v, "bytes": list(piece(t)[1])} for t, v in top]})
            return {"content": content, "refusal": None}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp, top in lps:
            s, _ = piece(token)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({piece(t)[0]: v for t, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def whole(self, res: Result, head: str = "", base: int = 0) -> dict:
        self.offset = base
        choice = self.choice(head + res.text, res.finish_reason, False, res.logprobs or ())
        if self.tools is not None:
            content, calls = parse_calls(res.text, self.tools.names)
            if calls:
                choice["message"] |= {"content": content, "tool_calls": calls}
                choice["finish_reason"] = _finish(res.finish_reason, calls)
        return {**self.base, "choices": [choice], "usage": usage(res), "timings": timings(res)}

    def chunks(self, stream: Stream, include_usage: bool, head: str = "", base: int = 0) -> Iterator[dict]:
        """OpenAI's chunks: usage, when asked for, in a last chunk of its own with no choices
        (where the SDK and LangChain read it); llama-server's `timings` on the finishing one."""
        if self.chat:
            yield {**self.base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                             "finish_reason": None}]}
        self.offset = base
        if self.tools is not None:
            yield from self._tool_chunks(stream)
        else:
            for piece in stream:
                yield {**self.base, "choices": [self.choice(head + piece.text, None, True, piece.logprobs)]}
                head = ""
            if head:  # nothing was generated: the echoed prompt still comes
                yield {**self.base, "choices": [self.choice(head, None, True)]}
            res = stream.result
            yield {**self.base, "choices": [self.choice(None, res.finish_reason, True)], "timings": timings(res)}
        res = stream.result
        if include_usage:  # with tools too (it was left out there)
            yield {**self.base, "choices": [], "usage": usage(res)}

    def _tool_chunks(self, stream: Stream) -> Iterator[dict]:
        """Chat chunks with calls as OpenAI streams them: a delta naming the call (id, function,
        empty arguments), then one with the arguments. Text that may open a call waits until it
        is one or is not (callparse.CallStream); logprobs ride on the next chunk that goes out."""
        split, pending, calls = CallStream(self.tools.names), [], []

        def out(parts, lps) -> Iterator[dict]:
            for part in parts:
                if isinstance(part, str):
                    yield {**self.base, "choices": [self.choice(part, None, True, lps)]}
                else:
                    call = {"index": len(calls), "id": part["id"], "type": "function",
                            "function": {"name": part["function"]["name"], "arguments": ""}}
                    calls.append(part)
                    yield {**self.base, "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None,
                                                     "finish_reason": None}]}
                    args = {"index": call["index"], "function": {"arguments": part["function"]["arguments"]}}
                    yield {**self.base, "choices": [{"index": 0, "delta": {"tool_calls": [args]},
                                                     "logprobs": self.logprobs(lps, "") if lps and
                                                     self.with_logprobs else None, "finish_reason": None}]}
                lps = ()

        for piece in stream:
            pending += piece.logprobs
            parts = list(split.feed(piece.text))
            if parts:
                yield from out(parts, tuple(pending))
                pending = []
        yield from out(split.flush(), tuple(pending))
        res = stream.result
        yield {**self.base, "choices": [self.choice(None, _finish(res.finish_reason, calls), True)],
               "timings": timings(res)}


def _finish(reason: str, calls: list) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class Call:
    """An OpenAI-style call, checked once: the engine's request and how its answer is shaped."""

    kind: str  # "completion" or "chat"
    request: Request
    tools: Tools | None = None  # the chat's functions, whose calls become `tool_calls`
    prompt_text: str = ""  # a completion's prompt: what `echo` puts first, where text_offset counts from
    echo: bool = False


def prepare(engine: Engine, tokens: Sequence[int], kind: str, *, tool_spec: Tools | None = None,
            prompt_text: str = "", echo: bool = False, **kwargs) -> Call:
    """A completion ("completion") or chat completion ("chat") of prompt tokens, checked: OpenAI
    names mapped (engine_kwargs), a tool_choice's grammar added, then every value checked and the
    grammar compiled by Engine.request. Raises InvalidParameterError / ContextOverflowError.
    `tool_spec`: a chat's parsed tools (already in its prompt); a raw `tools` field is refused."""
    args = constrain(tool_spec, engine_kwargs(kwargs, kind))
    return Call(kind, engine.request(list(tokens), **args), tool_spec, prompt_text, echo)


def respond(engine: Engine, call: Call, stream: bool = False, *, include_usage: bool = False,
            should_stop: Callable[[], bool] | None = None, arrived: float | None = None) -> dict | Iterator[dict]:
    """Run a call: the response, or its chunks with `stream` (`include_usage`: OpenAI's
    `stream_options.include_usage`)."""
    with_logprobs = call.request.top_logprobs is not None
    if call.kind == "chat":
        shape = _Shape(engine, "chat.completion.chunk" if stream else "chat.completion", "chatcmpl", with_logprobs,
                       call.tools)
    else:
        shape = _Shape(engine, "text_completion", "cmpl", with_logprobs)
    pieces = engine.run(call.request, should_stop=should_stop, arrived=arrived)
    head = call.prompt_text if call.echo else ""
    if stream:
        return shape.chunks(pieces, include_usage, head, len(call.prompt_text))
    return shape.whole(drain(pieces), head, len(call.prompt_text))


def create_completion(engine: Engine, prompt: str | Sequence[int], *, stream: bool = False, echo: bool = False,
                      suffix: str | None = None, **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_completion` on an engine (a dict, or chunks with stream=True);
    `echo` puts the prompt's text before the completion, as theirs does; with `suffix` the
    completion fills the gap between prompt and suffix (the model's FIM tokens, infill.py)."""
    if suffix is not None:
        if not isinstance(prompt, str) or not isinstance(suffix, str):
            raise InvalidParameterError("'suffix' must be a string, with a string prompt", "suffix")
        tokens = infill_tokens(engine.target, prompt, suffix, n_predict=kwargs.get("max_tokens") or 16,
                               field="suffix")
    else:
        tokens = engine.tokens_for(prompt, chat_template=False)
    text = prompt if isinstance(prompt, str) else engine.target.detokenize(tokens)
    return respond(engine, prepare(engine, tokens, "completion", prompt_text=text, echo=echo, **kwargs), stream)


def create_chat_completion(engine: Engine, messages: Sequence[Mapping[str, Any]], *, stream: bool = False,
                           tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                           **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_chat_completion` on an engine: like theirs, no token cap
    unless `max_tokens` is given (it runs to the end of the answer or of the context)."""
    spec = Tools.parse(tools, tool_choice)
    tokens = engine.chat_prompt(messages, spec)
    if kwargs.get("max_tokens") is None:
        kwargs["max_tokens"] = max(1, engine.target.n_ctx - len(tokens))
    if kwargs.get("temperature") is None:
        kwargs["temperature"] = CHAT_TEMPERATURE
    return respond(engine, prepare(engine, tokens, "chat", tool_spec=spec, **kwargs), stream)
