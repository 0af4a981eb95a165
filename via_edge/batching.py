"""Continuous batching: concurrent generations advance together, one llama_decode per model a step.

Each generation runs in its own thread with its own slot (one KV sequence in every model it
uses) and reaches its models through `BatchedSeq`, which has the same eval/decode/prefill verbs
as a `Seq`. A call plans its KV rollback at once, then waits while the scheduler gathers every
generation's pending tokens. When every active generation is waiting (or `linger` has passed
since the oldest call), the scheduler's own thread decodes for all: one `decode_batch` per model
holding every pending part, at most n_batch tokens; a long prompt continues in the next step,
beside the running generations' next tokens. Each call then returns its own rows.

Whichever thread decodes, llama.cpp's work itself always runs on the adapter's one compute
thread (llama/runtime.py, `_ComputeThread`: a second OpenMP team makes every barrier sleep;
docs/benchmarks.md section 21).

The decoding policy (decode.loop.Decoder) does not change: it still makes one call at a time, so
every mode batches, drafts and slim checks included.
"""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from .llama import LlamaModel, Seq, row_indices

DEFAULT_PARALLEL = 4  # the server's slots: measured in docs/benchmarks.md section 17


class _Call:
    """One pending eval of one sequence: tokens still to decode and the rows gathered so far."""

    __slots__ = ("seq", "tokens", "rows", "done_tokens", "out", "error", "finished", "since")

    def __init__(self, seq: Seq, tokens: Sequence[int], rows: list[int]) -> None:
        self.seq, self.tokens, self.rows = seq, tokens, rows
        self.done_tokens = 0
        self.out: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.finished = False
        self.since = time.perf_counter()

    def take(self, room: int) -> tuple[Seq, Sequence[int], list[int]]:
        """The next chunk of at most `room` tokens, with its rows relative to the chunk."""
        lo = self.done_tokens
        chunk = self.tokens[lo:lo + room]
        return self.seq, chunk, [r - lo for r in self.rows if lo <= r < lo + len(chunk)]

    def result(self) -> np.ndarray:
        if not self.out:
            return np.empty((0, self.seq.model.n_vocab), dtype=np.float32)
        return self.out[0] if len(self.out) == 1 else np.concatenate(self.out)


class Scheduler:
    """Gathers the calls of the active generations into shared decodes (see the module's doc)."""

    def __init__(self, linger: float = 0.05) -> None:
        self.linger = linger
        self._cv = threading.Condition()
        self._active = 0      # generations that hold a slot
        self._pending: list[_Call] = []  # one per generation blocked in a call, until its result is in
        self._stepped = 0.0   # when the last step ended: its callers need a moment to call again
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0        # decode_batch calls made (for the tests and the load benchmark)
        self._typical: dict[LlamaModel, float] = {}  # per model: median tokens per call in its last step

    def enter(self) -> None:
        with self._cv:
            self._active += 1

    def leave(self) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()  # the others may now all be waiting

    def others(self, model: LlamaModel) -> int:
        """Tokens the other active generations are likely to put into `model`'s next decode (a
        drafter sizing its draft for a shared step needs them): the last step's median per call
        (a prompt chunk in it is an exception, not the rule) for each of them."""
        return round(max(0, self._active - 1) * self._typical.get(model, 1.0))

    @contextmanager
    def away(self) -> Iterator[None]:
        """A generation working outside the shared batches for a while (a prompt on the prefill
        helper, llama/prefill.py): meanwhile the others' steps do not linger for its calls. Its
        decodes and theirs still take turns on the one compute thread, chunk by step."""
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def call(self, seq: Seq, tokens: Sequence[int], rows: list[int]) -> np.ndarray:
        seq.check_room(len(tokens))
        call = _Call(seq, tokens, rows)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="via-edge-decode", daemon=True)
                self._thread.start()
            self._pending.append(call)
            self._cv.notify_all()
            while not call.finished:
                self._cv.wait()
        if call.error is not None:
            raise call.error
        return call.result()

    def _loop(self) -> None:
        with self._cv:
            while not self._closed:
                wait = self._ready()
                if wait <= 0:
                    self._run_step()
                else:
                    self._cv.wait(wait)
            for call in self._pending:
                call.error, call.finished = RuntimeError("the engine is closed"), True
            self._cv.notify_all()

    def _ready(self) -> float:
        """0 when a step should run now, else how long to wait before asking again."""
        if not self._pending:
            return 1.0  # woken by the next call
        if len(self._pending) >= self._active:
            return 0.0
        # linger from the oldest call, or from the end of the last step when that is later: calls
        # made during a step are old by then, and must not start the next one before the step's
        # own callers (just woken) have had their moment, or the slots fall into taking turns
        since = max(self._pending[0].since, self._stepped)
        return self.linger - (time.perf_counter() - since)

    def _run_step(self) -> None:
        """One step: a decode per model over the pending calls. Entered and left holding the lock."""
        plan: dict[LlamaModel, list[_Call]] = {}
        for call in self._pending:
            plan.setdefault(call.seq.model, []).append(call)
        self._cv.release()
        try:
            for model, calls in plan.items():
                self._step(model, calls)
        finally:
            self._cv.acquire()
            self._stepped = time.perf_counter()
            self._pending = [c for c in self._pending if not c.finished]
            self._cv.notify_all()

    def _step(self, model: LlamaModel, calls: list[_Call]) -> None:
        """Short calls (next tokens, drafts) first, then prompt chunks in the room left."""
        room = model.n_batch
        parts, taken = [], []
        for call in sorted(calls, key=lambda c: len(c.tokens) - c.done_tokens):
            if room == 0:
                break
            part = call.take(room)
            parts.append(part)
            taken.append(call)
            room -= len(part[1])
        try:
            rows = model.decode_batch(parts)
        except BaseException as exc:  # every call in the batch fails alike (its KV was rolled back)
            for call in taken:
                call.error, call.finished = exc, True
            return
        self.steps += 1
        self._typical[model] = statistics.median(len(p[1]) for p in parts)
        for call, (_, chunk, _), out in zip(taken, parts, rows):
            call.done_tokens += len(chunk)
            if len(out):
                call.out.append(out)
            call.finished = call.done_tokens == len(call.tokens)


class BatchedSeq:
    """A `Seq` whose decodes go through the scheduler: the same verbs, the same KV contract."""

    def __init__(self, seq: Seq, scheduler: Scheduler) -> None:
        self.seq, self.scheduler = seq, scheduler
        self.n_ctx = seq.n_ctx

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    @property
    def usage(self):
        return self.seq.usage

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | str = "last") -> np.ndarray:
        if not tokens:
            raise ValueError("decode needs at least one token")
        return self.scheduler.call(self.seq, tokens, row_indices(rows, len(tokens)))

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray:
        missing, rows = self.seq.plan_eval(tokens, n_rows)
        return self.scheduler.call(self.seq, missing, rows)

    def prefill(self, tokens: Sequence[int]) -> None:
        missing = self.seq.plan_prefill(tokens)
        primer = self.seq.primer(len(missing))
        if primer is not None:  # a long prompt, decoded on the model's copy outside the shared batches
            with self.scheduler.away():
                primer.prime(self.seq, tokens, len(tokens) - len(missing), last=False)
        elif missing:
            self.scheduler.call(self.seq, missing, [])
