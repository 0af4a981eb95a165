"""`via-edge serve`: an OpenAI-compatible HTTP server around one Engine (FastAPI + uvicorn).

One engine, so requests are served one at a time in arrival order (an asyncio.Lock is FIFO, and
a thread lock keeps a cancelled request's worker exclusive until it has stopped); each generation
runs in a worker thread and stops at its next token when its client disconnects. Errors use
OpenAI's error JSON shape with the matching status code.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import Engine
from .errors import ViaEdgeError

MAX_BODY = 1 << 20


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def create_app(engine: Engine, *, max_body: int = MAX_BODY, max_tokens_limit: int = 4096):

    app = FastAPI(title="via-edge", version="0.1")
    turn = asyncio.Lock()
    state = {"served": 0, "cancelled": 0, "started": time.time()}
    engine_lock = threading.Lock()  # held by the worker thread for as long as it uses the engine

    def locked(fn: Callable[[], object]) -> object:
        """Run fn on the engine in this worker thread, alone, and count how it ended."""
        with engine_lock:
            try:
                return fn()
            finally:
                state["served"] += 1
                result = engine.last_result
                if result is not None and result.finish_reason == "cancelled":
                    state["cancelled"] += 1

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise _HTTPError(413, f"request body exceeds {max_body} bytes", code="body_too_large")
        body = await request.body()
        if len(body) > max_body:
            raise _HTTPError(413, f"request body exceeds {max_body} bytes", code="body_too_large")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise _HTTPError(400, f"malformed JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise _HTTPError(400, "the request body must be a JSON object", code="invalid_json")
        return data

    def check(data: dict, required: str) -> dict:
        """The generation parameters of a request, after checking model, size and limits."""
        model = data.get("model")
        if model is not None and model not in (engine.model_name, "via-edge"):
            raise _HTTPError(404, f"The model '{model}' does not exist", code="model_not_found", param="model")
        if required not in data:
            raise _HTTPError(400, f"'{required}' is required", param=required)
        if "max_completion_tokens" in data and "max_tokens" not in data:
            data["max_tokens"] = data["max_completion_tokens"]
        mt = data.get("max_tokens")
        if mt is not None:
            if not isinstance(mt, int) or mt < 1:
                raise _HTTPError(400, f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens")
            if mt > max_tokens_limit:
                raise _HTTPError(400, f"max_tokens may be at most {max_tokens_limit}", param="max_tokens")
        params = {k: data[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                       "mode") if k in data}
        params.setdefault("max_tokens", min(256, max_tokens_limit))
        return params

    async def serve(request: Request, make: Callable[[Callable[[], bool]], Iterator[dict] | dict], stream: bool):
        """Run one generation in a worker thread, in turn; stop it if the client goes away."""
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        if not stream:
            async with turn:
                task = loop.run_in_executor(None, locked, lambda: make(cancel.is_set))
                while not task.done():
                    if await request.is_disconnected():
                        cancel.set()
                    await asyncio.sleep(0.05)
                return JSONResponse(task.result())

        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            try:
                for chunk in make(cancel.is_set):
                    loop.call_soon_threadsafe(queue.put_nowait, ("data", chunk))
            except ViaEdgeError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
            finally:
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
    async def _http_error(_request, exc: "_HTTPError"):
        return _error(exc.status, exc.message, exc.kind, exc.code, exc.param)

    @app.exception_handler(ViaEdgeError)
    async def _user_error(_request, exc: ViaEdgeError):
        return _error(400, str(exc))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_name, "mode": engine.mode, "served": state["served"],
                "cancelled": state["cancelled"]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                            "created": int(state["started"]), "owned_by": "via-edge"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        data = await read_json(request)
        params = check(data, "prompt")
        prompt = data["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)):
            raise _HTTPError(400, "'prompt' must be a string or a list of token ids", param="prompt")
        stream = bool(data.get("stream"))
        return await serve(request, lambda stop: engine.create_completion(
            prompt, stream=stream, should_stop=stop, **params), stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        data = await read_json(request)
        params = check(data, "messages")
        messages = data["messages"]
        if not isinstance(messages, list) or not messages:
            raise _HTTPError(400, "'messages' must be a non-empty list", param="messages")
        messages = [{"role": m.get("role"), "content": _text(m.get("content"))} if isinstance(m, dict) else m
                    for m in messages]
        stream = bool(data.get("stream"))
        return await serve(request, lambda stop: engine.create_chat_completion(
            messages, stream=stream, should_stop=stop, **params), stream)

    return app


def _text(content) -> str | None:
    """OpenAI content may be a list of parts; keep the text parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param


def run(engine: Engine, host: str, port: int, **kwargs) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, **kwargs), host=host, port=port, log_level="warning")
