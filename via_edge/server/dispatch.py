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

    @property
    def queued(self) -> int:
        return max(0, self.admitted - self.n_slots)

    def admit(self) -> None:
        """Count a request in, or refuse it with 503 when every slot is taken and the queue is full."""
        if self.queued >= self.max_queue:
            raise HTTPError(503, f"the server is busy: every slot is generating and {self.queued} requests "
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



class Dispatcher:
    """Runs generations on the engine's slots, one worker thread each, and counts what it served."""

    def __init__(self, n_slots: int, max_queue: int) -> None:
        self.gate = Gate(n_slots, max_queue)  # made on the server's own event loop
        self.workers = ThreadPoolExecutor(max_workers=n_slots, thread_name_prefix="via-edge-slot")
        self.served = self.cancelled = 0

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)

    def _finished(self, finish_reason: str | None) -> None:
        self.served += 1
        self.cancelled += finish_reason == "cancelled"

    def _start(self, fn: Callable[[], None]) -> asyncio.Future:
        """`fn` on a worker; the slot is free again once it has returned, however it ended."""
        future = asyncio.get_running_loop().run_in_executor(self.workers, fn)
        future.add_done_callback(lambda _f: self.gate.release())
        return future

    async def respond(self, request: Request, make: Make, stream: bool):
        """Queue for a slot, run one generation, stop it if the client goes away."""
        arrived = time.perf_counter()
        self.gate.admit()
        cancel = threading.Event()
        if stream:
            return self._streamed(make, arrived, cancel)
        if not await self.gate.enter(request.is_disconnected):
            self._finished("cancelled")
            return JSONResponse({})  # nobody is listening
        box: dict = {}

        def work() -> None:
            box["out"] = make(cancel.is_set, arrived)

        task = self._start(work)
        try:
            while not task.done():
                if await request.is_disconnected():
                    cancel.set()
                await asyncio.wait({task}, timeout=0.05)
        finally:
            cancel.set()  # whatever ended the wait (a shutdown cancels it) ends the generation too
        task.result()
        out = box["out"]
        self._finished(out["choices"][0]["finish_reason"])
        return JSONResponse(out)

    def _streamed(self, make: Make, arrived: float, cancel: threading.Event) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            finish = "cancelled"
            try:
                for chunk in make(cancel.is_set, arrived):
                    if chunk["choices"]:  # not the usage chunk
                        finish = chunk["choices"][0]["finish_reason"] or finish
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
            if not await self.gate.enter():  # cancelled here (the client left) it leaves the queue too
                return
            self._start(produce)
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
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # the client is gone (or the stream ended): the worker stops at its next token

        def cleanup() -> None:
            """Runs however the response ended: a client gone before the body began leaves no count behind."""
            cancel.set()
            if not started:
                self.gate.forget()

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cleanup))
