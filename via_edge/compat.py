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
from .modes import DEFAULT_MODE
from .sampling import SAMPLING_NAMES

# llama-cpp-python's create_completion defaults, so a switched program behaves the same
DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
CHAT_TEMPERATURE = 0.2  # its create_chat_completion's default


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
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


# arguments llama-cpp-python takes that change nothing here at these values (its defaults); any
# other value is refused by name rather than silently ignored
NEUTRAL = dict(suffix=None, logprobs=None, top_logprobs=None, echo=False, frequency_penalty=0.0,
               presence_penalty=0.0, repeat_penalty=1.0, typical_p=1.0, tfs_z=1.0, mirostat_mode=0,
               mirostat_tau=5.0, mirostat_eta=0.1, stopping_criteria=None, logits_processor=None, grammar=None,
               logit_bias=None, response_format=None, tools=None, tool_choice=None, functions=None,
               function_call=None, n=1, best_of=None)
SHAPE_ONLY = ("stream", "model", "user")


def _params(kwargs: dict) -> dict:
    """Map OpenAI/llama-cpp-python argument names onto Engine.stream's; what via-edge does not
    do is refused by name (ValueError), never ignored."""
    out = {k: v for k, v in DEFAULTS.items()}
    for key, value in kwargs.items():
        if key in (*SAMPLING_NAMES, "max_tokens", "mode", "spec", "should_stop", "arrived"):
            if value is not None:
                out[key] = value
        elif key == "stop":
            if value is not None:
                out["stop"] = [value] if isinstance(value, str) else list(value)
        elif key in SHAPE_ONLY:
            continue
        elif key in NEUTRAL:
            if value is not None and value != NEUTRAL[key] and value is not False:
                raise InvalidParameterError(f"'{key}' is not supported by via-edge (got {value!r})")
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

    def chunks(self, stream: Stream, include_usage: bool) -> Iterator[dict]:
        """OpenAI's chunks: usage, when asked for, in a last chunk of its own with no choices
        (where the SDK and LangChain read it); llama-server's `timings` on the finishing one."""
        if self.chat:
            yield {**self.base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                             "finish_reason": None}]}
        for piece in stream:
            yield {**self.base, "choices": [self.choice(piece.text, None, True)]}
        res = stream.result
        yield {**self.base, "choices": [self.choice(None, res.finish_reason, True)], "timings": timings(res)}
        if include_usage:
            yield {**self.base, "choices": [], "usage": usage(res)}


def respond(engine: Engine, tokens: Sequence[int], kind: str, stream: bool = False, *, include_usage: bool = False,
            **kwargs) -> dict | Iterator[dict]:
    """A completion ("completion") or chat completion ("chat") of prompt tokens, whole or in chunks
    (`include_usage`: OpenAI's `stream_options.include_usage`)."""
    if kind == "chat":
        shape = _Shape(engine, "chat.completion.chunk" if stream else "chat.completion", "chatcmpl")
    else:
        shape = _Shape(engine, "text_completion", "cmpl")
    pieces = engine.stream(list(tokens), **_params(kwargs))
    if stream:
        return shape.chunks(pieces, include_usage)
    for _ in pieces:
        pass
    return shape.whole(pieces.result)


def create_completion(engine: Engine, prompt: str | Sequence[int], *, stream: bool = False, echo: bool = False,
                      **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_completion` on an engine (a dict, or chunks with stream=True);
    `echo` puts the prompt's text before the completion, as theirs does."""
    tokens = engine.tokens_for(prompt, chat_template=False)
    out = respond(engine, tokens, "completion", stream, **kwargs)
    if not echo:
        return out
    head = prompt if isinstance(prompt, str) else engine.target.detokenize(tokens)
    if not stream:
        out["choices"][0]["text"] = head + out["choices"][0]["text"]
        return out
    return _echoed(head, out)


def _echoed(head: str, chunks: Iterator[dict]) -> Iterator[dict]:
    for i, chunk in enumerate(chunks):
        if i == 0 and chunk["choices"]:
            chunk["choices"][0]["text"] = head + chunk["choices"][0]["text"]
        yield chunk


def create_chat_completion(engine: Engine, messages: Sequence[Mapping[str, str]], *, stream: bool = False,
                           **kwargs) -> dict | Iterator[dict]:
    """llama-cpp-python's `Llama.create_chat_completion` on an engine: like theirs, no token cap
    unless `max_tokens` is given (it runs to the end of the answer or of the context)."""
    tokens = engine.chat_prompt(messages)
    if kwargs.get("max_tokens") is None:
        kwargs["max_tokens"] = max(1, engine.target.n_ctx - len(tokens))
    if kwargs.get("temperature") is None:
        kwargs["temperature"] = CHAT_TEMPERATURE
    return respond(engine, tokens, "chat", stream, **kwargs)


# llama-cpp-python's constructor: knobs of speed or logging only, taken whatever their value...
_LOAD_SPEED_ONLY = ("n_batch", "n_ubatch", "n_threads_batch", "use_mmap", "use_mlock", "numa", "verbose",
                    "no_perf", "op_offload", "offload_kqv", "main_gpu", "split_mode", "tensor_split",
                    "last_n_tokens_size", "swa_full")
# ...and those that change results, taken only at their defaults (anything else is refused by name)
_LOAD_NEUTRAL = dict(vocab_only=False, kv_overrides=None, rope_scaling_type=-1, pooling_type=-1,
                     attention_type=-1, rope_freq_base=0.0, rope_freq_scale=0.0, yarn_ext_factor=-1.0,
                     yarn_attn_factor=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0,
                     logits_all=False, embedding=False, lora_base=None, lora_scale=1.0, lora_path=None,
                     chat_format=None, chat_handler=None, draft_model=None, tokenizer=None, type_k=None,
                     type_v=None, spm_infill=False)


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama-cpp-python's "random seed"


class Llama:
    """llama-cpp-python's `Llama` on a via-edge engine: code written for it switches by changing
    its import.

        from via_edge.compat import Llama                         # was: from llama_cpp import Llama
        llm = Llama(model_path="model.gguf", n_ctx=2048)          # or Llama.from_pair("qwen2.5-coder")
        llm("def fib(n):", max_tokens=64)["choices"][0]["text"]

    Generation runs in via-edge's default mode (`mode=` picks another). What via-edge does not do
    (logprobs, logit_bias, penalties, grammars, a draft_model of theirs, ...) is refused with a
    ValueError naming the argument, never ignored.
    """

    def __init__(self, model_path: str | None = None, *, n_ctx: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = 0, seed: int | None = None,
                 flash_attn: bool | None = None, mode: str | None = None, engine: Engine | None = None,
                 **kwargs) -> None:
        for key, value in kwargs.items():
            if key in _LOAD_SPEED_ONLY:
                continue
            if key not in _LOAD_NEUTRAL:
                raise InvalidParameterError(f"Llama(): unknown argument '{key}'")
            if value != _LOAD_NEUTRAL[key]:
                raise InvalidParameterError(f"Llama(): '{key}' is not supported by via-edge (got {value!r})")
        if engine is None:
            if model_path is None:
                raise InvalidParameterError("Llama() needs model_path (or use Llama.from_pair)")
            engine = Engine(model_path, mode=mode or DEFAULT_MODE, n_ctx=n_ctx, n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers, flash_attn=flash_attn)
        self.engine = engine
        self.model_path = str(engine.target_path)
        self.seed = None if seed == LLAMA_DEFAULT_SEED else seed  # for sampled calls that give none

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Llama":
        return cls(engine=Engine.from_pair(name, **kwargs))

    def n_ctx(self) -> int:
        return self.engine.target.n_ctx

    def n_vocab(self) -> int:
        return self.engine.target.n_vocab

    def token_eos(self) -> int:
        return self.engine.target.eos

    def token_bos(self) -> int:
        return self.engine.target.bos

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.engine.target.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        return b"".join(self.engine.target.token_bytes(t, special=special) for t in tokens)

    def _seeded(self, kwargs: dict) -> dict:
        if kwargs.get("seed") is None and self.seed is not None:
            kwargs["seed"] = self.seed
        return kwargs

    def create_completion(self, prompt: str | Sequence[int], **kwargs) -> dict | Iterator[dict]:
        return create_completion(self.engine, prompt, **self._seeded(kwargs))

    __call__ = create_completion

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], **kwargs) -> dict | Iterator[dict]:
        return create_chat_completion(self.engine, messages, **self._seeded(kwargs))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
