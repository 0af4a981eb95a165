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

protocol  request bodies, errors, checks (what a request asks for)
dispatch  the queue and the slots' worker threads (how it is run)
app       the routes, the listening socket and the process's lifetime
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import sys
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..errors import RemoteDeviceError, ViaEdgeError
from ..llama import rpc
from ..openai_api.infill import as_llama_server
from ..openai_api.responses import Call, respond
from .dispatch import Dispatcher
from .protocol import ChatBody, CompletionBody, HTTPError, InfillBody, Requests

MAX_BODY = 1 << 20


def create_app(engine: Engine, *, max_body: int = MAX_BODY, max_tokens_limit: int = 4096, max_queue: int = 16,
               api_keys: tuple[str, ...] = (), on_ready: Callable[[], None] | None = None) -> FastAPI:
    """With `api_keys`, every route but /health needs `Authorization: Bearer <one of them>`."""
    requests = Requests(engine, max_body, max_tokens_limit)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        app.state.dispatch = Dispatcher(engine.n_parallel, max_queue)  # on the server's own event loop
        if on_ready is not None:  # the socket is listening by now: say so
            on_ready()
        yield
        app.state.dispatch.close()

    app = FastAPI(title="via-edge", version="0.1", lifespan=lifespan)
    started = time.time()
    fmt = engine.weight_format  # read once: the GGUF header does not change while serving

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        if api_keys and request.url.path != "/health":
            scheme, _, key = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in api_keys):
                return HTTPError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key "
                                 "this server was started with (--api-key)", code="invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def _route_error(_request, exc: StarletteHTTPException):
        """Unknown routes and methods in OpenAI's error shape, as every other refusal."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = HTTPError(exc.status_code, f"{exc.detail}: {_request.method} {_request.url.path}",
                             code=code).response()
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(HTTPError)
    async def _http_error(_request, exc: HTTPError):
        response = exc.response()
        if exc.status == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(ViaEdgeError)
    async def _user_error(_request, exc: ViaEdgeError):
        if isinstance(exc, RemoteDeviceError):  # the target's RPC server is gone: nothing the request can fix
            return HTTPError(503, str(exc), kind="server_error", code="rpc_failed").response()
        return HTTPError(400, str(exc)).response()

    def slots() -> dict:
        """The context split the way llama-server splits it: n_ctx_total over `parallel` slots."""
        return {"parallel": engine.n_parallel, "n_ctx": engine.target.n_ctx, "n_ctx_slot": engine.target.n_ctx,
                "n_ctx_total": engine.target.n_ctx_total}

    @app.get("/health")
    async def health(request: Request):
        d: Dispatcher = request.app.state.dispatch
        out = {"status": "ok", "model": engine.model_name, "mode": engine.mode, **slots(), "weights": fmt,
               "slots_busy": engine.slots_busy, "queued": d.gate.queued, "max_queue": d.gate.max_queue,
               "served": d.served, "cancelled": d.cancelled}
        if engine.load.rpc:
            failed = rpc.failure()
            out["rpc"] = f"an RPC server failed: {failed}" if failed else f"ok: {', '.join(engine.load.rpc)}"
            if failed:
                return JSONResponse(out | {"status": "error"}, status_code=503)
        return out

    @app.post("/slots")
    async def slots_action(action: str):
        """llama-server's slot erase, for every slot at once: forget the cached prompts (a benchmark
        that must start cold, or a user who wants the memory back). Refused while any generates."""
        if action != "erase":
            raise HTTPError(400, f"unknown slot action {action!r}; the one action is 'erase'", param="action")
        if engine.slots_busy:
            raise HTTPError(409, f"{engine.slots_busy} slots are generating; erase when idle", code="slots_busy")
        engine.reset()
        return {"erased": engine.n_parallel}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": int(started),
                                            "owned_by": "via-edge", "meta": {**slots(), "mode": engine.mode,
                                                                            "weights": fmt}}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await requests.read(request, CompletionBody)
        tokens = requests.completion_tokens(body)
        call = requests.call(body, tokens, prompt_text=requests.prompt_text(body, tokens), echo=body.echo)
        return await generate(request, call, body)

    @app.post("/infill")
    async def infill(request: Request):
        """llama-server's fill-in-the-middle endpoint, for editor plugins written for it."""
        body = await requests.read(request, InfillBody)
        tokens = requests.fim_tokens(body.input_prefix, body.input_suffix, body.max_tokens, "input_suffix", body)
        return await generate(request, requests.call(body, tokens), body, as_llama_server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await requests.read(request, ChatBody)
        tools = requests.tools(body)
        call = requests.call(body, requests.chat_tokens(body, tools), tool_spec=tools)
        return await generate(request, call, body)

    async def generate(request: Request, call: Call, body: CompletionBody | ChatBody | InfillBody,
                       shape: Callable[[dict], dict | None] | None = None):
        """Queue the checked call; its worker runs it (`shape`: answered in another API's shape)."""
        usage = body.stream_options is not None and body.stream_options.include_usage

        def make(stop: Callable[[], bool], arrived: float):
            return respond(engine, call, body.stream, include_usage=usage, should_stop=stop, arrived=arrived)

        return await request.app.state.dispatch.respond(request, make, body.stream, shape)

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
    seconds (saying how many); queued requests get a 503, and what still runs at the deadline is
    stopped and answered in full (dispatch.Dispatcher)."""
    import uvicorn

    app = create_app(engine, on_ready=on_ready, **kwargs)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            dispatch = app.state.dispatch
            if not self.should_exit:
                if engine.slots_busy or dispatch.gate.queued:
                    sys.stderr.write(f"via-edge: stopping; {engine.slots_busy} running generations may finish for "
                                     f"up to {drain:g} s, {dispatch.gate.queued} queued requests get a 503\n")
                    sys.stderr.flush()
                dispatch.stop(drain)  # signal handlers run on the event loop's thread
            super().handle_exit(sig, frame)

    # uvicorn cuts connections at its own deadline: give the dispatcher's (which answers them) time to act first
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain + 5)
    Server(config).run(sockets=[sock])

