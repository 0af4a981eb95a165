"""llama.cpp's process-wide state: the library, its log, and the one thread that computes.

The only place that imports llama_cpp; the rest of the adapter reaches it through `lib()`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable

log = logging.getLogger("via_edge.llama")
if log.level == logging.NOTSET:
    log.setLevel(logging.ERROR)  # quiet by default; lower it to see llama.cpp's own log

_init_lock = threading.Lock()
_initialized = False
_log_callback = None  # must outlive every log line llama.cpp prints, so it lives here forever
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


def lib():
    """The llama_cpp bindings module (imported on first use: `via-edge --help` needs no library)."""
    import llama_cpp

    return llama_cpp


def backend_init() -> None:
    """Initialise llama.cpp once per process and route its log to Python logging."""
    global _initialized, _log_callback
    with _init_lock:
        if _initialized:
            return
        lc = lib()

        def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            py_level = _LEVELS.get(level, logging.DEBUG)
            if log.isEnabledFor(py_level) and text:
                log.log(py_level, "%s", text.decode("utf-8", "replace").rstrip("\n"))

        _log_callback = lc.llama_log_callback(_on_log)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialized = True


class _ComputeThread:
    """The one thread of the process that runs llama.cpp's compute: model loads and decodes.

    llama.cpp's CPU backend runs each graph in an OpenMP team owned by the calling thread, and
    libgomp gives every new calling thread a team of its own. Once the process holds more team
    threads than CPUs, libgomp stops spinning at barriers and sleeps on a futex at each of the
    graph's hundreds of barriers. Measured (AMX build, where loading repacks weights in OpenMP
    loops; docs/benchmarks.md section 21): loaded in the main thread and decoded in a worker,
    15.6 tok/s with 18,000 context switches per team thread for 48 tokens; loaded and decoded in
    one thread, 27-28 tok/s. So every caller hands its llama.cpp work to this one thread.

    A caller waits for its call to finish even through Ctrl-C, then raises KeyboardInterrupt:
    the KV cache and each sequence's `tokens` never disagree, and the batch is never refilled
    while llama.cpp still reads it.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no such thread yet

    def _reset(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._current: Future | None = None  # the call the thread is running

    def abandon(self, exc: BaseException) -> None:
        """The running call will never return (ggml aborted inside it, see rpc.catch_aborts): fail
        it with `exc` and serve later calls from a new thread, with a queue of its own."""
        with self._start_lock:
            current, self._current = self._current, None
            self._queue, self._thread = queue.SimpleQueue(), None
        if current is not None and not current.done():
            current.set_exception(exc)

    def run(self, fn: Callable, *args, timeout: float | None = None):
        if threading.current_thread() is self._thread or sys.is_finalizing():
            return fn(*args)  # at exit the thread may be gone: a model freed then is freed here
        future: Future = Future()
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, args=(self._queue,), name="via-edge-llama",
                                                daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args))
        interrupted = False
        while True:
            try:
                result = future.result(timeout)
                break
            except KeyboardInterrupt:
                interrupted = True
            except FutureTimeout:
                self.abandon(TimeoutError(f"no result within {timeout:g} s"))
                raise TimeoutError(f"no result within {timeout:g} s") from None
        if interrupted:
            raise KeyboardInterrupt
        return result

    def _serve(self, calls: queue.SimpleQueue) -> None:
        while True:
            future, fn, args = calls.get()
            self._current = future
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, raised there
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)


_compute = _ComputeThread()


def on_compute_thread(fn: Callable, *args, timeout: float | None = None):
    """Run `fn(*args)` on the thread that owns llama.cpp's compute (see `_ComputeThread`); with a
    `timeout`, a call still running then is abandoned and raises TimeoutError."""
    return _compute.run(fn, *args, timeout=timeout)


def abandon_compute(exc: BaseException) -> None:
    """Fail the running compute call with `exc`; later calls get a fresh compute thread."""
    _compute.abandon(exc)


def system_info() -> str:
    """llama.cpp's build features (SIMD, backends): part of what decides a machine's costs."""
    try:
        return lib().llama_print_system_info().decode()
    except Exception:  # a build without the call still gets a stable answer
        return ""


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def extra_bufts_default() -> bool:
    """`VIA_EDGE_EXTRA_BUFTS=0` turns off weight repacking everywhere (exact greedy equality)."""
    return os.environ.get("VIA_EDGE_EXTRA_BUFTS", "1").strip().lower() not in ("0", "false", "no", "off")


# What makes a multi-token batch compute exactly what single-token decodes compute (see LoadParams
# and docs/benchmarks.md, "kernels"). Quantized models: no weight repacking, and batches of at most
