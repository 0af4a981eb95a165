"""The OpenAI request side of the server: typed bodies, OpenAI-shaped errors, and each request
turned into the engine's tokens and keywords, every value checked before the request waits for a slot."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..responses import DEFAULTS, engine_kwargs
from ..constraints import LogitRules, grammar_text
from ..engine import Engine
from ..errors import ContextOverflowError, InvalidParameterError, ViaEdgeError
from ..modes import MODE_NAMES, check_logprobs
from ..sampling import SAMPLING_NAMES, SamplingParams
from ..tools import Tools, constrain


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


# OpenAI and llama-server fields that change what is generated: responses.engine_kwargs does each
# one or refuses it by name (a 400 naming the field), never ignores it
GENERATION_FIELDS = ("n", "best_of", "logprobs", "top_logprobs", "logit_bias", "presence_penalty",
                     "frequency_penalty", "repeat_penalty", "response_format", "grammar", "tools", "tool_choice",
                     "functions", "function_call", "prediction")


RULE_FIELDS = ("logit_bias", "presence_penalty", "frequency_penalty", "repeat_penalty")


class _Body(BaseModel):
    """Fields every generation request shares; fields that do not change the output (user,
    metadata...) are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    mode: Literal[MODE_NAMES] | None = None  # type: ignore[valid-type]
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repeat_penalty: Any = None
    response_format: Any = None
    grammar: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: StrictStr


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[_TextPart], None] = None  # None: an assistant turn of tool calls
    tool_calls: list[dict] | None = None
    tool_call_id: StrictStr | None = None

    def turn(self, i: int) -> dict:
        """Message `i` as the chat template takes it (tools.template_messages does the rest)."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        if text is None and not (self.role == "assistant" and self.tool_calls):
            raise HTTPError(400, f"invalid 'messages.{i}.content': a {self.role} message needs it (only an assistant "
                            "turn of tool calls may leave it null)", param=f"messages.{i}.content", code="invalid_value")
        out = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    echo: Any = None  # not an OpenAI chat field: refused by name


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    echo: bool = False
    suffix: Any = None


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


_TAGS = {"str", "int", "float", "bool", "none"}


def _field(loc: tuple) -> str:
    """`messages.0.content` from pydantic's location, without the union branch it tried last."""
    out = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or "-" in p or p in _TAGS or p[:1].isupper() or p[:1] == "_"):
            break
        out.append(str(p))
    return ".".join(out)


def _invalid(exc: ValidationError) -> HTTPError:
    first = exc.errors()[0]
    where = _field(first["loc"]) or "body"
    return HTTPError(400, f"invalid '{where}': {first['msg']} (got {first.get('input')!r:.60})", param=where,
                      code="invalid_value")



class Requests:
    """Reads and checks requests for one engine under the server's limits."""

    def __init__(self, engine: Engine, max_body: int, max_tokens_limit: int) -> None:
        self.engine, self.max_body, self.max_tokens_limit = engine, max_body, max_tokens_limit

    async def read(self, request: Request, model: type[_Body]) -> _Body:
        """The body, refused as soon as it grows past `max_body` (chunked or not), as a typed model."""
        too_large = HTTPError(413, f"request body exceeds {self.max_body} bytes", code="body_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                raise too_large
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise HTTPError(400, f"malformed JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise _invalid(exc) from exc

    def params(self, body: _Body) -> dict:
        """Engine.stream's keywords for a request, every value checked."""
        engine, limit = self.engine, self.max_tokens_limit
        if body.model is not None and body.model not in (engine.model_name, "via-edge"):
            raise HTTPError(404, f"The model '{body.model}' does not exist", code="model_not_found", param="model")
        mt = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if mt is not None and mt < 1:
            raise HTTPError(400, f"max_tokens must be a positive integer, got {mt}", param="max_tokens")
        if mt is not None and mt > limit:
            raise HTTPError(400, f"max_tokens may be at most {limit}, got {mt}", param="max_tokens")
        out = {k: getattr(body, k) for k in (*SAMPLING_NAMES, "mode", "stop")
               if getattr(body, k) is not None}
        out["max_tokens"] = mt if mt is not None else min(256, limit)
        if body.stream_options is not None:
            if not body.stream:
                raise HTTPError(400, "'stream_options' is only allowed when 'stream' is true",
                                param="stream_options")
            out["include_usage"] = body.stream_options.include_usage
        sampling = {k: out[k] for k in SAMPLING_NAMES if k in out}
        try:
            SamplingParams(**{k: DEFAULTS[k] for k in SAMPLING_NAMES if k in DEFAULTS} | sampling)
        except ViaEdgeError as exc:
            raise HTTPError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from exc
        if isinstance(body, ChatBody) and body.echo is not None:
            raise HTTPError(400, "'echo' is not supported for chat completions", param="echo",
                            code="unsupported_parameter")
        if isinstance(body, CompletionBody) and body.suffix is not None:
            raise HTTPError(400, "'suffix' is not supported by via-edge", param="suffix", code="unsupported_parameter")
        out |= {k: getattr(body, k) for k in GENERATION_FIELDS if getattr(body, k) is not None}
        chat = isinstance(body, ChatBody)
        try:
            tools = Tools.parse(out.pop("tools", None), out.pop("tool_choice", None)) if chat else None
            shaping = ("include_usage",)  # how the answer is sent, not what it is
            checked = constrain(tools, engine_kwargs({k: v for k, v in out.items() if k not in shaping},
                                                     "chat" if chat else "completion"))
            if tools is not None:
                out["tools"] = tools
            check_logprobs(checked.get("mode") or engine.mode, checked["logprobs"])
            LogitRules.make(engine.target.n_vocab, **{k: checked[k] for k in RULE_FIELDS if k in checked})
            gbnf = grammar_text(checked.get("grammar"), checked.get("response_format"))
            if gbnf:
                engine.target.grammar(gbnf).close()  # parses, or says where it does not
        except InvalidParameterError as exc:
            param = exc.param or ("grammar" if "grammar" in out else "response_format")
            raise HTTPError(400, str(exc), param=param, code="invalid_value") from exc
        return out

    def prompt_text(self, body: CompletionBody, tokens: list[int]) -> str:
        """The prompt as text, as given: what `echo` puts first, where logprobs' offsets start."""
        prompt = body.prompt
        if isinstance(prompt, str):
            return prompt
        return prompt[0] if isinstance(prompt[0], str) else self.engine.target.detokenize(tokens)

    def completion_tokens(self, body: CompletionBody) -> list[int]:
        """The prompt of /v1/completions: one string or one list of token ids."""
        engine, prompt = self.engine, body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise HTTPError(400, "'prompt' may hold one string only (no batches)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._fits(engine.tokens_for(prompt, chat_template=False))
        bad = next((t for t in prompt if not 0 <= t < engine.target.n_vocab), None)
        if bad is not None or not prompt:
            raise HTTPError(400, f"'prompt' token ids must be in 0..{engine.target.n_vocab - 1}"
                            + (f", got {bad}" if bad is not None else ", got an empty list"), param="prompt",
                            code="invalid_value")
        return self._fits(list(prompt))

    def chat_tokens(self, body: ChatBody, tools: Tools | None) -> list[int]:
        try:
            return self._fits(self.engine.chat_prompt([m.turn(i) for i, m in enumerate(body.messages)], tools))
        except InvalidParameterError as exc:
            raise HTTPError(400, str(exc), param=exc.param or "messages", code="invalid_value") from exc

    def _fits(self, tokens: list[int]) -> list[int]:
        try:
            self.engine.check_fits(tokens)
        except ContextOverflowError as exc:
            raise HTTPError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
        return tokens
