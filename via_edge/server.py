"""`via-edge serve`: an OpenAI-compatible HTTP server around one Engine (FastAPI + uvicorn).

The engine has `n_parallel` slots; up to that many requests generate at once, batched into shared
decodes (batching.py), each in a worker thread that stops at its next token when its client
disconnects and then frees its slot. Requests beyond the slots wait in a FIFO queue of at most
`max_queue`; one more gets an OpenAI-shaped 503 (with Retry-After) at once, never a hang. A request
that hangs up while queued leaves the queue. Each response's `timings.queued_ms` says how long it
waited.

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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Iterator, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from .compat import DEFAULTS, respond
from .engine import Engine
from .errors import ContextOverflowError, ViaEdgeError
from .modes import MODE_NAMES
from .sampling import SAMPLING_NAMES, SamplingParams

MAX_BODY = 1 << 20


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


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
    stream_options: _StreamOptions | None = None
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


class _Gate:
    """The slots and the bounded queue in front of them (event-loop side; FIFO like asyncio's
    Semaphore). A request counts from its admission until it leaves the queue without a slot or
    its slot is released; those beyond the slots are the queue."""

    def __init__(self, slots: int, max_queue: int) -> None:
        self.slots, self.n_slots, self.max_queue = asyncio.Semaphore(slots), slots, max_queue
        self.admitted = 0

    @property
    def queued(self) -> int:
        return max(0, self.admitted - self.n_slots)

    def admit(self) -> None:
        """Count a request in, or refuse it with 503 when every slot is taken and the queue is full."""
        if self.queued >= self.max_queue:
            raise _HTTPError(503, f"the server is busy: every slot is generating and {self.queued} requests "
                             f"are queued (--max-queue {self.max_queue}); retry shortly", kind="server_error",
                             code="server_busy")
        self.admitted += 1

    async def enter(self, gone: Callable[[], Awaitable[bool]] | None = None) -> bool:
        """Wait for a slot (False if `gone` says the client left first, and it is counted out)."""
        taken = False
        try:
            if gone is None:
                await self.slots.acquire()
                taken = True
                return True
            take = asyncio.ensure_future(self.slots.acquire())
            while not take.done():
                await asyncio.wait({take}, timeout=0.1)
                if not take.done() and await gone():
                    take.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await take
                    if take.cancelled():
                        return False
            taken = True
            return True
        finally:
            if not taken:
                self.forget()

    def release(self) -> None:
        self.slots.release()
        self.forget()

    def forget(self) -> None:
        """Count out an admitted request: its slot was released, or it never took one."""
        self.admitted -= 1


def create_app(engine: Engine, *, max_body: int = MAX_BODY, max_tokens_limit: int = 4096, max_queue: int = 16,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    workers = ThreadPoolExecutor(max_workers=engine.n_parallel, thread_name_prefix="via-edge-slot")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        app.state.gate = _Gate(engine.n_parallel, max_queue)  # made on the server's own event loop
        if on_ready is not None:  # the socket is listening by now: say so
            on_ready()
        yield
        workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="via-edge", version="0.1", lifespan=lifespan)
    state = {"served": 0, "cancelled": 0, "started": time.time()}

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
        out = {k: getattr(body, k) for k in (*SAMPLING_NAMES, "mode", "stop")
               if getattr(body, k) is not None}
        out["max_tokens"] = mt if mt is not None else min(256, max_tokens_limit)
        if body.stream_options is not None:
            if not body.stream:
                raise _HTTPError(400, "'stream_options' is only allowed when 'stream' is true",
                                 param="stream_options")
            out["include_usage"] = body.stream_options.include_usage
        sampling = {k: out[k] for k in SAMPLING_NAMES if k in out}
        try:
            SamplingParams(**{k: DEFAULTS[k] for k in SAMPLING_NAMES if k in DEFAULTS} | sampling)
        except ViaEdgeError as exc:
            raise _HTTPError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from exc
        return out

    def fits(tokens: list[int]) -> list[int]:
        try:
            engine.check_fits(tokens)
        except ContextOverflowError as exc:
            raise _HTTPError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
        return tokens

    def parse(model: type[_Body], data: dict) -> _Body:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise _invalid(exc) from exc

    Make = Callable[[Callable[[], bool], float], "Iterator[dict] | dict"]

    async def serve(request: Request, make: Make, stream: bool):
        """Queue for a slot, run one generation in a worker thread, stop it if the client goes away."""
        arrived = time.perf_counter()
        gate: _Gate = request.app.state.gate
        gate.admit()
        cancel = threading.Event()
        loop = asyncio.get_running_loop()

        def run(fn: Callable[[], None]) -> asyncio.Future:
            """`fn` on a worker; the slot is free again once it has returned, however it ended."""
            future = loop.run_in_executor(workers, fn)
            future.add_done_callback(lambda _f: gate.release())
            return future

        if not stream:
            if not await gate.enter(request.is_disconnected):
                finished("cancelled")
                return JSONResponse({})  # nobody is listening
            box: dict = {}

            def work() -> None:
                box["out"] = make(cancel.is_set, arrived)

            task = run(work)
            try:
                while not task.done():
                    if await request.is_disconnected():
                        cancel.set()
                    await asyncio.wait({task}, timeout=0.05)
            finally:
                cancel.set()  # whatever ended the wait (a shutdown cancels it) ends the generation too
            task.result()
            out = box["out"]
            finished(out["choices"][0]["finish_reason"])
            return JSONResponse(out)

        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            finish = "cancelled"
            try:
                for chunk in make(cancel.is_set, arrived):
                    if chunk["choices"]:  # not the usage chunk
                        finish = chunk["choices"][0]["finish_reason"] or finish
                    loop.call_soon_threadsafe(queue.put_nowait, ("data", chunk))
            except ViaEdgeError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
                finished(finish)

        started = False

        async def events():
            nonlocal started
            started = True
            if not await gate.enter():  # cancelled here (the client left) it leaves the queue too
                return
            run(produce)
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

        def cleanup() -> None:
            """Runs however the response ended: a client gone before the body began leaves no count behind."""
            cancel.set()
            if not started:
                gate.forget()

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cleanup))

    @app.exception_handler(_HTTPError)
    async def _http_error(_request, exc: _HTTPError):
        response = exc.response()
        if exc.status == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(ViaEdgeError)
    async def _user_error(_request, exc: ViaEdgeError):
        return _HTTPError(400, str(exc)).response()

    fmt = engine.weight_format  # read once: the GGUF header does not change while serving

    def slots() -> dict:
        """The context split the way llama-server splits it: n_ctx_total over `parallel` slots."""
        return {"parallel": engine.n_parallel, "n_ctx": engine.target.n_ctx, "n_ctx_slot": engine.target.n_ctx,
                "n_ctx_total": engine.target.n_ctx_total}

    @app.get("/health")
    async def health(request: Request):
        gate: _Gate = request.app.state.gate
        return {"status": "ok", "model": engine.model_name, "mode": engine.mode, **slots(), "weights": fmt,
                "slots_busy": engine.slots_busy, "queued": gate.queued, "max_queue": gate.max_queue,
                "served": state["served"], "cancelled": state["cancelled"]}

    @app.post("/slots")
    async def slots_action(action: str):
        """llama-server's slot erase, for every slot at once: forget the cached prompts (a benchmark
        that must start cold, or a user who wants the memory back). Refused while any generates."""
        if action != "erase":
            raise _HTTPError(400, f"unknown slot action {action!r}; the one action is 'erase'", param="action")
        if engine.slots_busy:
            raise _HTTPError(409, f"{engine.slots_busy} slots are generating; erase when idle", code="slots_busy")
        engine.reset()
        return {"erased": engine.n_parallel}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                            "created": int(state["started"]), "owned_by": "via-edge",
                                            "meta": {**slots(), "mode": engine.mode, "weights": fmt}}]}

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
        return await serve(request, lambda stop, arrived: respond(engine, tokens, "completion", body.stream,
                                                                  should_stop=stop, arrived=arrived, **kw),
                           body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse(ChatBody, await read_json(request))
        kw = params(body)
        tokens = fits(engine.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages]))
        return await serve(request, lambda stop, arrived: respond(engine, tokens, "chat", body.stream,
                                                                  should_stop=stop, arrived=arrived, **kw),
                           body.stream)

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


def run(engine: Engine, sock: socket.socket, on_ready: Callable[[], None] | None = None, drain: float = 10.0,
        **kwargs) -> None:
    """Serve until SIGTERM or Ctrl-C, then let running generations finish for up to `drain`
    seconds (saying how many), and cancel what is left."""
    import uvicorn

    app = create_app(engine, on_ready=on_ready, **kwargs)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if not self.should_exit and (engine.slots_busy or app.state.gate.queued):
                sys.stderr.write(f"via-edge: stopping; {engine.slots_busy} running generations may finish for "
                                 f"up to {drain:g} s, {app.state.gate.queued} queued requests are dropped\n")
                sys.stderr.flush()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain)
    Server(config).run(sockets=[sock])

