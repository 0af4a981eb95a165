"""`via-edge serve`: an OpenAI-compatible HTTP server around one Engine (FastAPI + uvicorn).

One engine, so requests are served one at a time in arrival order (an asyncio.Lock is FIFO, and
a thread lock keeps a cancelled request's worker exclusive until it has stopped); each generation
runs in a worker thread and stops at its next token when its client disconnects.

Every request is checked completely before it waits for its turn: the body's size while it is
read in (chunked or not), its fields against typed models, sampling values, the prompt's token
ids against the vocabulary and its length against the context. A bad request gets OpenAI's error
JSON with status 400 (413 for a body too large) naming the field, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Callable, Iterator, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from .compat import DEFAULTS, respond
from .engine import Engine
from .errors import ViaEdgeError
from .modes import MODE_NAMES
from .sampling import SamplingParams

MAX_BODY = 1 << 20


class _Body(BaseModel):
    """Fields every generation request shares; unknown OpenAI fields are accepted and ignored."""

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
    mode: Literal[MODE_NAMES] | None = None  # type: ignore[valid-type]


class _TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: StrictStr


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Union[StrictStr, list[_TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)


class CompletionBody(_Body):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]


class _HTTPError(Exception):
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


def _invalid(exc: ValidationError) -> _HTTPError:
    first = exc.errors()[0]
    where = _field(first["loc"]) or "body"
    return _HTTPError(400, f"invalid '{where}': {first['msg']} (got {first.get('input')!r:.60})", param=where,
                      code="invalid_value")


def create_app(engine: Engine, *, max_body: int = MAX_BODY, max_tokens_limit: int = 4096,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if on_ready is not None:  # the socket is listening by now: say so
            on_ready()
        yield

    app = FastAPI(title="via-edge", version="0.1", lifespan=lifespan)
    turn = asyncio.Lock()
    state = {"served": 0, "cancelled": 0, "started": time.time()}
    engine_lock = threading.Lock()  # held by the worker thread for as long as it uses the engine

    def finished(finish_reason: str | None) -> None:
        state["served"] += 1
        state["cancelled"] += finish_reason == "cancelled"

    async def read_json(request: Request) -> dict:
        """The body as a JSON object, refused as soon as it grows past `max_body` (chunked or not)."""
        too_large = _HTTPError(413, f"request body exceeds {max_body} bytes", code="body_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                raise too_large
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise _HTTPError(400, f"malformed JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise _HTTPError(400, "the request body must be a JSON object", code="invalid_json")
        return data

    def params(body: _Body) -> dict:
        """Engine.stream's keywords for a request, every value checked."""
        if body.model is not None and body.model not in (engine.model_name, "via-edge"):
            raise _HTTPError(404, f"The model '{body.model}' does not exist", code="model_not_found", param="model")
        mt = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if mt is not None and mt < 1:
            raise _HTTPError(400, f"max_tokens must be a positive integer, got {mt}", param="max_tokens")
        if mt is not None and mt > max_tokens_limit:
            raise _HTTPError(400, f"max_tokens may be at most {max_tokens_limit}, got {mt}", param="max_tokens")
        out = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "mode", "stop")
               if getattr(body, k) is not None}
        out["max_tokens"] = mt if mt is not None else min(256, max_tokens_limit)
        sampling = {k: out[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed") if k in out}
        try:
            SamplingParams(**{k: DEFAULTS[k] for k in ("temperature", "top_p", "top_k", "min_p")} | sampling)
        except ViaEdgeError as exc:
            raise _HTTPError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from exc
        return out

    def fits(tokens: list[int]) -> list[int]:
        if len(tokens) >= engine.target.n_ctx:
            raise _HTTPError(400, f"the prompt has {len(tokens)} tokens but the context window holds "
                             f"{engine.target.n_ctx}", param="prompt", code="context_length_exceeded")
        return tokens

    def parse(model: type[_Body], data: dict) -> _Body:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise _invalid(exc) from exc

    async def serve(request: Request, make: Callable[[Callable[[], bool]], Iterator[dict] | dict], stream: bool):
        """Run one generation in a worker thread, in turn; stop it if the client goes away."""
        cancel = threading.Event()
        loop = asyncio.get_running_loop()

        def locked(fn: Callable[[], object]) -> object:
            with engine_lock:
                return fn()

        if not stream:
            async with turn:
                task = loop.run_in_executor(None, locked, lambda: make(cancel.is_set))
                while not task.done():
                    if await request.is_disconnected():
                        cancel.set()
                    await asyncio.sleep(0.05)
                out = task.result()
                finished(out["choices"][0]["finish_reason"])
                return JSONResponse(out)

        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            last = None
            try:
                for chunk in make(cancel.is_set):
                    last = chunk
                    loop.call_soon_threadsafe(queue.put_nowait, ("data", chunk))
            except ViaEdgeError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
            finally:
                finished(last["choices"][0]["finish_reason"] if last else "cancelled")
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

        async def events():
            async with turn:
                loop.run_in_executor(None, locked, produce)
                try:
                    while True:
                        kind, item = await queue.get()
                        if kind == "end":
                            break
                        if kind == "error":
                            item = {"error": {"message": item, "type": "invalid_request_error",
                                              "param": None, "code": None}}
                        yield f"data: {json.dumps(item)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    cancel.set()  # the client is gone (or the stream ended): the worker stops at its next token

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(_HTTPError)
    async def _http_error(_request, exc: _HTTPError):
        return exc.response()

    @app.exception_handler(ViaEdgeError)
    async def _user_error(_request, exc: ViaEdgeError):
        return _HTTPError(400, str(exc)).response()

    fmt = engine.weight_format  # read once: the GGUF header does not change while serving

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name, "mode": engine.mode, "n_ctx": engine.target.n_ctx,
                "weights": fmt,
                "served": state["served"], "cancelled": state["cancelled"]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                            "created": int(state["started"]), "owned_by": "via-edge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionBody, await read_json(request))
        kw = params(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise _HTTPError(400, "'prompt' may hold one string only (no batches)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = engine.tokens_for(prompt, chat_template=False)
        else:
            bad = next((t for t in prompt if not 0 <= t < engine.target.n_vocab), None)
            if bad is not None or not prompt:
                raise _HTTPError(400, f"'prompt' token ids must be in 0..{engine.target.n_vocab - 1}"
                                 + (f", got {bad}" if bad is not None else ", got an empty list"), param="prompt",
                                 code="invalid_value")
            tokens = list(prompt)
        fits(tokens)
        return await serve(request, lambda stop: respond(engine, tokens, "completion", body.stream,
                                                         should_stop=stop, **kw), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatBody, await read_json(request))
        kw = params(body)
        tokens = fits(engine.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages]))
        return await serve(request, lambda stop: respond(engine, tokens, "chat", body.stream,
                                                         should_stop=stop, **kw), body.stream)

    return app


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before any model loads, so a busy port fails at once."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ViaEdgeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                           + (" (another server uses it; pick another --port)" if exc.errno == 98 else "")) from exc
    return sock


def run(engine: Engine, sock: socket.socket, on_ready: Callable[[], None] | None = None, **kwargs) -> None:
    import uvicorn

    config = uvicorn.Config(create_app(engine, on_ready=on_ready, **kwargs), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])

