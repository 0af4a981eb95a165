"""The OpenAI request side of the server: typed bodies, OpenAI-shaped errors, and each request
turned into a checked `responses.Call` (the engine's `Request`) before it waits for a slot."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..decode.modes import MODE_NAMES
from ..engine import Engine
from ..errors import ContextOverflowError, InvalidParameterError
from ..openai_api.infill import extra_chunks, infill_tokens
from ..openai_api.responses import Call, prepare
from ..openai_api.toolcalls import Tools


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


# how a request is sent and answered, not what is generated: the rest of a body goes to
# responses.engine_kwargs, which does each field or refuses it by name (a 400), never ignores it
TRANSPORT = {"model", "stream", "stream_options", "max_completion_tokens", "messages", "prompt", "echo",
             "suffix", "input_prefix", "input_suffix", "input_extra", "n_predict"}  # the last: the prompt's parts


class _Body(BaseModel):
    """Fields every generation request shares; fields that do not change the output (user,
    metadata...) are accepted and ignored. Fields typed Any are checked by the engine."""

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


class _Part(BaseModel):
    """A content part; only text parts are read (`_Message.turn` refuses the others by name)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: StrictStr
    text: StrictStr | None = None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[_Part], None] = None  # None: an assistant turn of tool calls
    tool_calls: list[dict] | None = None
    tool_call_id: StrictStr | None = None

    def turn(self, i: int) -> dict:
        """Message `i` as the chat template takes it (toolcalls.template_messages does the rest)."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text" or part.text is None:
                raise HTTPError(400, f"invalid 'messages.{i}.content.{j}.type': a '{part.type}' part; via-edge's "
                                "models read text only, so every part must be {\"type\": \"text\", \"text\": ...}",
                                param=f"messages.{i}.content.{j}.type", code="unsupported_content")
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


class InfillBody(_Body):
    """llama-server's `/infill`: the text around the gap, other files as context, and what of the
    middle is typed already (`prompt`). Greedy unless `temperature` is given; its scheduling hints
    (`cache_prompt`, `samplers`, `t_max_prompt_ms`, `t_max_predict_ms`, `n_indent`, `id_slot`,
    `response_fields`) are accepted and ignored."""

    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: Any = None
    prompt: StrictStr = ""
    n_predict: StrictInt | None = None
    temperature: float | None = 0.0

    def model_post_init(self, _context: Any) -> None:
        if self.max_tokens is None and self.n_predict is not None and self.n_predict >= 0:  # -1: no limit
            self.max_tokens = self.n_predict


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

    def call(self, body: _Body, tokens: list[int], **shape) -> Call:
        """The request's one check: the server's own limits here, everything else by the engine
        (responses.prepare), each refusal a 400 naming the field."""
        engine, limit = self.engine, self.max_tokens_limit  # any `model` name is this engine's, as in llama-server
        mt = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if mt is not None and mt > limit:
            raise HTTPError(400, f"max_tokens may be at most {limit}, got {mt}", param="max_tokens")
        if body.stream_options is not None and not body.stream:
            raise HTTPError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if isinstance(body, ChatBody) and body.echo is not None:
            raise HTTPError(400, "'echo' is not supported for chat completions", param="echo",
                            code="unsupported_parameter")
        chat = isinstance(body, ChatBody)  # a chat's tools are in its prompt and `shape`; completions refuse them
        kwargs = {k: v for k, v in body.model_dump(exclude=TRANSPORT | ({"tools", "tool_choice"} if chat else set()))
                  .items() if v is not None}
        kwargs["max_tokens"] = mt if mt is not None else min(256, limit)
        kind = "chat" if chat else "completion"
        try:
            return prepare(engine, tokens, kind, **shape, **kwargs)
        except ContextOverflowError as exc:
            raise HTTPError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
        except InvalidParameterError as exc:
            param = exc.param or str(exc).split(" ", 1)[0]
            raise HTTPError(400, str(exc), param=param, code="invalid_value") from exc

    def tools(self, body: ChatBody) -> Tools | None:
        try:
            return Tools.parse(body.tools, body.tool_choice)
        except InvalidParameterError as exc:
            raise HTTPError(400, str(exc), param=exc.param or "tools", code="invalid_value") from exc

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
        if body.suffix is not None:  # fill in the middle: the prompt is what comes before the gap
            if not isinstance(body.suffix, str) or not isinstance(prompt, str):
                raise HTTPError(400, "'suffix' must be a string, with a string 'prompt'", param="suffix",
                                code="invalid_value")
            return self.fim_tokens(prompt, body.suffix, body.max_tokens, "suffix")
        if isinstance(prompt, str):
            return engine.tokens_for(prompt, chat_template=False)
        bad = next((t for t in prompt if not 0 <= t < engine.target.n_vocab), None)
        if bad is not None or not prompt:
            raise HTTPError(400, f"'prompt' token ids must be in 0..{engine.target.n_vocab - 1}"
                            + (f", got {bad}" if bad is not None else ", got an empty list"), param="prompt",
                            code="invalid_value")
        return list(prompt)

    def fim_tokens(self, prefix: str, suffix: str, max_tokens: int | None, field: str,
                   infill: InfillBody | None = None) -> list[int]:
        """A fill-in-the-middle prompt (openai_api/infill.py): llama-server's layout for /infill,
        llama-cpp-python's for `suffix`; a model without FIM tokens is a 400."""
        try:
            extra = extra_chunks(infill.input_extra) if infill is not None else None
            return infill_tokens(self.engine.target, prefix, suffix, extra, infill.prompt if infill else "",
                                 max_tokens or 256, field)
        except InvalidParameterError as exc:
            raise HTTPError(400, str(exc), param=exc.param, code="invalid_value") from exc

    def chat_tokens(self, body: ChatBody, tools: Tools | None) -> list[int]:
        try:
            return self.engine.chat_prompt([m.turn(i) for i, m in enumerate(body.messages)], tools)
        except InvalidParameterError as exc:
            raise HTTPError(400, str(exc), param=exc.param or "messages", code="invalid_value") from exc
