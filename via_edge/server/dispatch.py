"""Requests to slots: the bounded queue in front of the engine's slots, and each generation run in
a worker thread that stops at its next token once its client has gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from ..errors import RemoteDeviceError, ViaEdgeError
from .protocol import HTTPError

# one generation: given "should it stop?" and the request's arrival time, a response or its chunks
Make = Callable[[Callable[[], bool], float], "Iterator[dict] | dict"]


class Gate:
    """The slots and the bounded queue in front of them (event-loop side; FIFO like asyncio's
    Semaphore). A request counts from its admission until it leaves the queue without a slot or
    its slot is released; those beyond the slots are the queue."""

    def __init__(self, slots: int, max_queue: int) -> None:
        self.slots, self.n_slots, self.max_queue = asyncio.Semaphore(slots), slots, max_queue
        self.admitted = 0
        self.closed = False  # shutting down: nothing new starts, the queue is turned away

    @property
    def queued(self) -> int:
        return max(0, self.admitted - self.n_slots)

    def admit(self) -> None:
        """Count a request in, or refuse it with 503 when every slot is taken and the queue is full,
        or the server is shutting down."""
        if self.closed:
            raise shutting_down()
        if self.queued >= self.max_queue:
            raise HTTPError(503, f"the server is busy: every slot is generating and {self.queued} requests "
                             f"are queued (--max-queue {self.max_queue}); retry shortly", kind="server_error",
                             code="server_busy")
        self.admitted += 1

    async def enter(self, gone: Callable[[], Awaitable[bool]]) -> bool:
        """Wait for a slot: False if `gone` says the client left first (it is counted out); a 503
        if the server starts shutting down meanwhile."""
        taken = False
        try:
            take = asyncio.ensure_future(self.slots.acquire())
            while not take.done():
                await asyncio.wait({take}, timeout=0.1)
                if not take.done() and (self.closed or await gone()):
                    take.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await take
                    if take.cancelled():
                        if self.closed:
                            raise shutting_down()
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



def shutting_down() -> HTTPError:
    return HTTPError(503, "the server is shutting down; retry on another server or after it restarts",
                     kind="server_error", code="shutting_down")


class Dispatcher:
    """Runs generations on the engine's slots, one worker thread each, and counts what it served.

    Shutdown (`stop`): queued and new requests get a 503 at once; running ones may finish until
    the drain deadline, where each is stopped at its next token and still answered in full: a
    body with finish_reason "length", or a stream's final chunk and [DONE].
    """

    def __init__(self, n_slots: int, max_queue: int) -> None:
        self.gate = Gate(n_slots, max_queue)  # made on the server's own event loop
        self.workers = ThreadPoolExecutor(max_workers=n_slots, thread_name_prefix="via-edge-slot")
        self.served = self.cancelled = 0
        self.loop = asyncio.get_running_loop()
        self.running: set[threading.Event] = set()  # the stop signal of each running generation
        self.cut: set[threading.Event] = set()      # those the drain deadline stopped

    def stop(self, drain: float) -> None:
        """Begin the shutdown (from a signal handler): turn the queue away, cut what runs at `drain` s."""
        def begin() -> None:
            self.gate.closed = True
            self.loop.call_later(drain, self._deadline)

        self.loop.call_soon_threadsafe(begin)

    def _deadline(self) -> None:
        for cancel in list(self.running):
            self.cut.add(cancel)
            cancel.set()

    def _reason(self, finish_reason: str | None, cancel: threading.Event) -> str | None:
        """A generation the deadline cut ends as one cut short by a limit, which clients know."""
        return "length" if finish_reason == "cancelled" and cancel in self.cut else finish_reason

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)

    def _finished(self, finish_reason: str | None) -> None:
        self.served += 1
        self.cancelled += finish_reason == "cancelled"

    def _start(self, fn: Callable[[], None], cancel: threading.Event) -> asyncio.Future:
        """`fn` on a worker; the slot is free again once it has returned, however it ended."""
        self.running.add(cancel)
        future = asyncio.get_running_loop().run_in_executor(self.workers, fn)

        def done(_f) -> None:
            self.running.discard(cancel)
            self.gate.release()

        future.add_done_callback(done)
        return future

    async def respond(self, request: Request, make: Make, stream: bool,
                      shape: Callable[[dict], dict | None] | None = None):
        """Queue for a slot (the status is decided there: a stream's 200 goes out only once it has
        one), run one generation, stop it if the client goes away. `shape` turns each OpenAI
        response or chunk into another API's (None: the chunk is not sent), and a stream so
        shaped ends without OpenAI's [DONE]."""
        arrived = time.perf_counter()
        self.gate.admit()
        if not await self.gate.enter(request.is_disconnected):
            self._finished("cancelled")
            return JSONResponse({})  # nobody is listening
        cancel = threading.Event()
        if stream:
            return self._streamed(make, arrived, cancel, shape)
        box: dict = {}

        def work() -> None:
            box["out"] = make(cancel.is_set, arrived)

        task = self._start(work, cancel)
        try:
            while not task.done():
                if await request.is_disconnected():
                    cancel.set()
                await asyncio.wait({task}, timeout=0.05)
        finally:
            cancel.set()  # whatever ended the wait (a shutdown cancels it) ends the generation too
        task.result()
        out = box["out"]
        for choice in out["choices"]:
            choice["finish_reason"] = self._reason(choice["finish_reason"], cancel)
        self._finished(out["choices"][0]["finish_reason"])
        return JSONResponse(out if shape is None else shape(out))

    def _streamed(self, make: Make, arrived: float, cancel: threading.Event,
                  shape: Callable[[dict], dict | None] | None) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            finish = "cancelled"
            try:
                for chunk in make(cancel.is_set, arrived):
                    if chunk["choices"]:  # not the usage chunk
                        reason = chunk["choices"][0]["finish_reason"] = self._reason(
                            chunk["choices"][0]["finish_reason"], cancel)
                        finish = reason or finish
                    loop.call_soon_threadsafe(queue.put_nowait, ("data", chunk))
            except ViaEdgeError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
                self._finished(finish)

        started = False

        async def events():
            nonlocal started
            started = True
            self._start(produce, cancel)
            try:
                while True:
                    kind, item = await queue.get()
                    if kind == "end":
                        break
                    if kind == "error":
                        remote = isinstance(item, RemoteDeviceError)
                        item = {"error": {"message": str(item), "param": getattr(item, "param", None),
                                          "type": "server_error" if remote else "invalid_request_error",
                                          "code": "rpc_failed" if remote else None}}
                    elif shape is not None:
                        item = shape(item)
                        if item is None:
                            continue
                    yield f"data: {json.dumps(item)}\n\n"
                if shape is None:
                    yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # the client is gone (or the stream ended): the worker stops at its next token

        def cleanup() -> None:
            """Runs however the response ended: a client gone before the body began frees its slot."""
            cancel.set()
            if not started:
                self.gate.release()
                self._finished("cancelled")

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cleanup))
