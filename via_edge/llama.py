"""The llama.cpp adapter: the only module that touches ctypes.

One `LlamaModel` is a loaded GGUF with one context holding one or more KV sequences (`Seq`, one
per server slot); the model's own decode/eval methods work on sequence 0. A sequence remembers
which tokens its KV cache holds, so callers hand it the whole token context and it decodes only
what is new, rolling back whatever diverged. `decode_batch` carries several sequences' tokens in
one llama_decode (the scheduler's continuous batching).

Logits come back as read-only numpy views onto llama.cpp's output buffer (no copy of the
vocabulary per row); a view is valid until the next decode on the same model.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from .errors import ContextOverflowError, InvalidParameterError, ModelFileError
from .gguf_info import open_reader
from .stats import ModelUsage

log = logging.getLogger("via_edge.llama")
if log.level == logging.NOTSET:
    log.setLevel(logging.ERROR)  # quiet by default; lower it to see llama.cpp's own log

_init_lock = threading.Lock()
_initialized = False
_log_callback = None  # must outlive every log line llama.cpp prints, so it lives here forever
MAX_SEQ = 64  # sequences per context we accept (llama.cpp's own limit is higher)
_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type values
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


def _llama_cpp():
    import llama_cpp

    return llama_cpp


def _backend_init() -> None:
    """Initialise llama.cpp once per process and route its log to Python logging."""
    global _initialized, _log_callback
    with _init_lock:
        if _initialized:
            return
        lc = _llama_cpp()

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

    def run(self, fn: Callable, *args):
        if threading.current_thread() is self._thread or sys.is_finalizing():
            return fn(*args)  # at exit the thread may be gone: a model freed then is freed here
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._serve, name="via-edge-llama", daemon=True)
                    thread.start()
                    self._thread = thread
        future: Future = Future()
        self._queue.put((future, fn, args))
        interrupted = False
        while True:
            try:
                result = future.result()
                break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt
        return result

    def _serve(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, raised there
                future.set_exception(exc)


_compute = _ComputeThread()


def on_compute_thread(fn: Callable, *args):
    """Run `fn(*args)` on the thread that owns llama.cpp's compute (see `_ComputeThread`)."""
    return _compute.run(fn, *args)


def quantize(source: Path, dest: Path, ftype: str, *, output_type: str | None = None,
             embedding_type: str | None = None, metadata: Mapping[str, str | int] = {},
             threads: int | None = None) -> None:
    """llama_model_quantize: every weight to `ftype`'s base type (pure), requantizing quantized
    ones, the LM head or token embedding to their own types if given, `metadata` written into
    the file's header. Blocks until done; raises RuntimeError on failure."""
    _backend_init()
    lc = _llama_cpp()
    p = lc.llama_model_quantize_default_params()
    p.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.allow_requantize = True
    p.pure = True
    p.nthread = threads or 0
    if output_type:
        p.output_tensor_type = getattr(lc, f"GGML_TYPE_{output_type}")
    if embedding_type:
        p.token_embedding_type = getattr(lc, f"GGML_TYPE_{embedding_type}")
    kv = (lc.llama_model_kv_override * (len(metadata) + 1))()  # zeroed last entry ends the list
    for slot, (key, value) in zip(kv, metadata.items()):
        slot.key = key.encode()
        if isinstance(value, int):
            slot.tag, slot.value.val_i64 = lc.LLAMA_KV_OVERRIDE_TYPE_INT, value
        else:
            slot.tag, slot.value.val_str = lc.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
    p.kv_overrides = ctypes.cast(kv, type(p.kv_overrides))
    status = lc.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(p))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize returned {status}")


def system_info() -> str:
    """llama.cpp's build features (SIMD, backends): part of what decides a machine's costs."""
    try:
        return _llama_cpp().llama_print_system_info().decode()
    except Exception:  # a build without the call still gets a stable answer
        return ""


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def extra_bufts_default() -> bool:
    """`VIA_EDGE_EXTRA_BUFTS=0` turns off weight repacking everywhere (exact greedy equality)."""
    return os.environ.get("VIA_EDGE_EXTRA_BUFTS", "1").strip().lower() not in ("0", "false", "no", "off")


# What makes a multi-token batch compute exactly what single-token decodes compute (see LoadParams
# and docs/benchmarks.md, "kernels"). Quantized models: no weight repacking, and batches of at most
# 7 tokens (llama.cpp's defaults otherwise). F32 models: also an F32 KV cache and no flash attention.
EXACT = {"use_extra_bufts": False}
EXACT_F32 = {"use_extra_bufts": False, "kv_type": "f32", "flash_attn": False}


@dataclass(frozen=True)
class LoadParams:
    """How to load a GGUF.

    Batched and single-token decodes agree only as far as the kernels allow. Measured here:
    quantized models without weight repacking (`use_extra_bufts=False`) give bit-identical logits
    for batches of up to 7 tokens and differ from 8 on; with repacking, from 4 on. F32 models agree
    to ~1e-5 for any batch with an F32 KV cache and flash attention off (`EXACT_F32`).
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = -1
    flash_attn: bool | None = None
    use_extra_bufts: bool | None = None
    kv_type: str = "f16"
    capture: tuple[str, ...] = field(default=())
    n_seq: int = 1             # sequences (server slots) sharing the context; n_ctx is their total
    kv_unified: bool = False   # one KV buffer all sequences attend through (else one per sequence)

    def resolved_extra_bufts(self) -> bool:
        return extra_bufts_default() if self.use_extra_bufts is None else self.use_extra_bufts


class LlamaModel:
    """A GGUF loaded into llama.cpp with one context; release with `close()` or `with`."""

    def __init__(
        self,
        path: str | os.PathLike,
        params: LoadParams = LoadParams(),
        *,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self._model = None
        self._ctx = None
        self._batch = None
        self.path = Path(path)
        reader = open_reader(self.path)  # clear errors for missing, foreign and truncated files
        del reader
        _backend_init()
        lc = _llama_cpp()
        self.params = params

        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = params.n_gpu_layers
        mp.use_extra_bufts = params.resolved_extra_bufts()
        if progress is not None:
            def _on_progress(value: float, _user: ctypes.c_void_p) -> bool:
                progress(float(value))
                return True

            self._progress_cb = lc.llama_progress_callback(_on_progress)
            mp.progress_callback = self._progress_cb
        self._model = on_compute_thread(lc.llama_model_load_from_file, str(self.path).encode(), mp)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not load {self.path} (unsupported or damaged model)")
        self._vocab = lc.llama_model_get_vocab(self._model)

        n_ctx_train = lc.llama_model_n_ctx_train(self._model)
        if not 1 <= params.n_seq <= MAX_SEQ:
            raise InvalidParameterError(f"the number of sequences must be in 1..{MAX_SEQ}, got {params.n_seq}")
        per_seq = params.n_ctx // params.n_seq  # split the way llama-server splits it over its slots
        per_seq = min(per_seq, n_ctx_train) if n_ctx_train > 0 else per_seq
        if per_seq < 16:
            raise InvalidParameterError(f"n_ctx={params.n_ctx} over {params.n_seq} sequences leaves "
                                        f"{per_seq} tokens each; raise n_ctx (--ctx)")
        n_ctx = per_seq * params.n_seq
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = min(params.n_batch, n_ctx)
        cp.n_ubatch = min(params.n_ubatch, cp.n_batch)
        cp.n_seq_max = params.n_seq
        cp.kv_unified = params.kv_unified
        cp.n_threads = params.n_threads or default_threads()
        cp.n_threads_batch = params.n_threads_batch or cp.n_threads
        cp.flash_attn_type = {None: lc.LLAMA_FLASH_ATTN_TYPE_AUTO, True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[params.flash_attn]
        if params.kv_type not in _KV_TYPES:
            raise InvalidParameterError(f"kv_type must be one of {', '.join(_KV_TYPES)}")
        cp.type_k = cp.type_v = _KV_TYPES[params.kv_type]
        cp.no_perf = True
        self._capture = _Capture(params.capture) if params.capture else None
        if self._capture is not None:
            cp.cb_eval = self._capture.callback
        self._ctx = on_compute_thread(lc.llama_init_from_model, self._model, cp)
        if not self._ctx:
            self.close()
            raise ModelFileError(f"llama.cpp could not create a context for {self.path}")
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_ctx_total = lc.llama_n_ctx(self._ctx)
        self.n_ctx = self.n_ctx_total // params.n_seq  # what one sequence may hold
        self.n_batch = cp.n_batch
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.n_layer = lc.llama_model_n_layer(self._model)
        self.n_embd = lc.llama_model_n_embd(self._model)
        self.n_ctx_train = n_ctx_train
        self.bos = lc.llama_vocab_bos(self._vocab)
        self.eos = lc.llama_vocab_eos(self._vocab)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.vocab_type = lc.llama_vocab_type(self._vocab)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._logits_ptr_type = ctypes.POINTER(ctypes.c_float)
        self.lock = threading.Lock()  # one llama.cpp call on this context at a time
        self.seqs = [Seq(self, i, self.n_ctx) for i in range(params.n_seq)]
        self.usage = ModelUsage()  # every decode, whichever sequences it carried

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model once no call is using it (a server's worker may still be decoding)."""
        if not (self._model or self._ctx or self._batch is not None):
            return
        lock = getattr(self, "lock", None)
        if lock is None or sys.is_finalizing():  # half-built, or at exit, where a holder may be frozen
            self._free()
            return
        with lock:
            on_compute_thread(self._free)

    def _free(self) -> None:
        lc = _llama_cpp()
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- vocabulary -----------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        lc = _llama_cpp()
        try:
            data = text if isinstance(text, bytes) else text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. JSON's "\ud800"
            raise InvalidParameterError(f"the text is not valid Unicode: a lone surrogate "
                                        f"{text[exc.start]!r} at character {exc.start}") from None
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token: may be part of a UTF-8 character (see text.StreamDecoder)."""
        lc = _llama_cpp()
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Iterable[int], *, special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> bytes:
        """The vocabulary's stored text for a token (what llama.cpp compares between models)."""
        return _llama_cpp().llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(_llama_cpp().llama_vocab_is_eog(self._vocab, token))

    @property
    def chat_template(self) -> str | None:
        raw = _llama_cpp().llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    # ---- decoding (sequence 0; other sequences through `seqs`) ---------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.seqs[0].tokens

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self.seqs[0].tokens = value

    @property
    def n_past(self) -> int:
        return len(self.seqs[0].tokens)

    def truncate(self, n: int) -> None:
        self.seqs[0].truncate(n)

    def reset(self) -> None:
        """Empty every sequence's KV cache."""
        with self.lock:
            _llama_cpp().llama_memory_clear(self._mem, True)
            for seq in self.seqs:
                seq.tokens.clear()

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | str = "last") -> np.ndarray:
        return self.seqs[0].decode(tokens, rows)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.seqs[0].prefill(tokens)

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray:
        return self.seqs[0].eval(tokens, n_rows)

    def seq_state(self) -> bytes:
        return self.seqs[0].state()

    def set_seq_state(self, data: bytes, tokens: Sequence[int]) -> None:
        self.seqs[0].set_state(data, tokens)

    def decode_batch(self, parts: Sequence[tuple["Seq", Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """One llama_decode of several sequences' tokens: `parts` are (sequence, tokens appended at
        its next positions, row indices into those tokens), at most `n_batch` tokens in all.

        Returns each part's rows as its own array (copied: another part's owner may decode again
        before this one has read them).
        """
        total = sum(len(toks) for _, toks, _ in parts)
        if not 0 < total <= self.n_batch:
            raise ValueError(f"a batch holds 1..{self.n_batch} tokens, got {total}")
        for seq, toks, _ in parts:
            if seq.n_past + len(toks) > seq.n_ctx:
                raise ContextOverflowError(f"context window full: {seq.n_past} + {len(toks)} tokens exceed "
                                           f"the sequence's n_ctx={seq.n_ctx}")
        # in ascending sequence order: llama.cpp splits a batch of unordered sequences into one
        # ubatch per sequence (measured: 4 sequences x 1 token 172 ms in order, 277-350 ms shuffled)
        order = sorted(range(len(parts)), key=lambda i: parts[i][0].id)
        out: list[np.ndarray] = [None] * len(parts)  # type: ignore[list-item]
        with self.lock:
            logits = self._run([parts[i] for i in order])
            at = 0
            for i in order:
                n = len(parts[i][2])
                out[i] = np.array(logits[at:at + n])
                at += n
        return out

    def _run(self, parts: Sequence[tuple["Seq", Sequence[int], Sequence[int]]]) -> np.ndarray:
        """Fill the batch, decode, account; logits rows in batch order (a view). Caller holds the lock."""
        if self._batch is None:
            raise RuntimeError(f"{self.path.name} is closed")
        lc = _llama_cpp()
        b = self._batch
        i = n_rows = 0
        starts = []
        for seq, chunk, rows in parts:
            pos0, sid = len(seq.tokens), seq.id
            starts.append(pos0)
            flags = bytearray(len(chunk))
            for r in rows:
                flags[r] = 1
            n_rows += len(rows)
            for j, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = pos0 + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = sid
                b.logits[i] = flags[j]
                i += 1
        b.n_tokens = i
        if self._capture is not None:
            self._capture.begin()
        rc, dt = on_compute_thread(self._decode, b)
        self.usage.calls += 1
        self.usage.tokens += i
        self.usage.seconds += dt
        if rc != 0:
            # the cache may hold part of the batch: drop it so every `tokens` stays the truth
            for (seq, chunk, _), pos0 in zip(parts, starts):
                lc.llama_memory_seq_rm(self._mem, seq.id, pos0, -1)
            if rc == 1:
                raise ContextOverflowError(f"no KV cache slot for {i} tokens")
            raise RuntimeError(f"llama_decode failed with code {rc}")
        for seq, chunk, _ in parts:
            seq.tokens.extend(chunk)
            seq.usage.calls += 1
            seq.usage.tokens += len(chunk)
            seq.usage.seconds += dt
        if not n_rows:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        ptr = ctypes.cast(lc.llama_get_logits(self._ctx), self._logits_ptr_type)
        view = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
        view.flags.writeable = False
        return view

    def _decode(self, batch) -> tuple[int, float]:
        """llama_decode on the compute thread: its return code and seconds."""
        lc = _llama_cpp()
        t0 = time.perf_counter()
        rc = lc.llama_decode(self._ctx, batch)
        lc.llama_synchronize(self._ctx)  # Metal computes asynchronously; time the real work
        return rc, time.perf_counter() - t0

    def captured(self, name: str) -> np.ndarray:
        """Rows of an intermediate tensor (e.g. `l_out-3`) from the last decode; needs `capture`."""
        if self._capture is None:
            raise RuntimeError("load with LoadParams(capture=(...)) to read intermediate tensors")
        return self._capture.result(name, self.n_embd)


class Seq:
    """One sequence of a model's KV cache: its id, the tokens it holds (position i = tokens[i]),
    its share of the context and of the decode work.

    It hands the model the whole token context and decodes only what is new, rolling back
    whatever diverged: that is how the draft, the slim verifier and the target stay in sync
    without re-prefilling each round.
    """

    def __init__(self, model: LlamaModel, seq_id: int, n_ctx: int) -> None:
        self.model, self.id, self.n_ctx = model, seq_id, n_ctx
        self.tokens: list[int] = []
        self.usage = ModelUsage()

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Roll this sequence's KV back so that it holds its first `n` tokens."""
        if n < len(self.tokens):
            with self.model.lock:
                _llama_cpp().llama_memory_seq_rm(self.model._mem, self.id, n, -1)
            del self.tokens[n:]

    def reset(self) -> None:
        self.truncate(0)

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | str = "last") -> np.ndarray:
        """Append `tokens` at the next positions; logits for the asked rows (indices into `tokens`).

        `rows` is "last", "all", "none" or a sorted list of indices. Returns (len(rows), n_vocab)
        float32, a read-only view when the rows fall in one llama.cpp batch.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        want = row_indices(rows, n)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"context window full: {self.n_past} + {n} tokens exceed its {self.n_ctx}; raise n_ctx (--ctx)"
            )
        model = self.model
        out = None
        filled = 0
        for start in range(0, n, model.n_batch):
            chunk = tokens[start:start + model.n_batch]
            chunk_rows = [r - start for r in want if start <= r < start + len(chunk)]
            with model.lock:
                view = model._run(((self, chunk, chunk_rows),))
            if chunk_rows and len(chunk_rows) == len(want):
                return view
            if chunk_rows:
                if out is None:
                    out = np.empty((len(want), model.n_vocab), dtype=np.float32)
                out[filled:filled + len(chunk_rows)] = view
                filled += len(chunk_rows)
        return out if out is not None else np.empty((0, model.n_vocab), dtype=np.float32)

    def plan_prefill(self, tokens: Sequence[int]) -> Sequence[int]:
        """Roll back to the common prefix with `tokens`; what is left to decode."""
        keep = common_prefix(self.tokens, tokens)
        self.truncate(keep)
        return tokens[keep:]

    def prefill(self, tokens: Sequence[int]) -> None:
        """Make the KV cache hold exactly `tokens`, computing no logits."""
        missing = self.plan_prefill(tokens)
        if missing:
            self.decode(missing, "none")

    def plan_eval(self, tokens: Sequence[int], n_rows: int) -> tuple[Sequence[int], list[int]]:
        """Roll back for an eval of `tokens`: (tokens to decode, their rows to return)."""
        n = len(tokens)
        if not 1 <= n_rows <= n:
            raise ValueError(f"n_rows must be in 1..{n}")
        keep = reuse_point(self.tokens, tokens, n_rows)
        self.truncate(keep)
        missing = tokens[keep:]
        first_row = len(missing) - n_rows
        return missing, list(range(first_row, len(missing)))

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray:
        """Make the KV cache hold exactly `tokens`; logits of its last `n_rows` positions.

        Reuses the longest common prefix already in the cache, rolls back the rest and decodes
        what is missing in one batch. Row j predicts the token after tokens[len - n_rows + j].
        """
        return self.decode(*self.plan_eval(tokens, n_rows))

    # ---- state (KV import for prefix slims) -----------------------------------------------------
    def state(self) -> bytes:
        lc = _llama_cpp()
        with self.model.lock:
            ctx = self.model._ctx
            size = lc.llama_state_seq_get_size(ctx, self.id)
            buf = (ctypes.c_uint8 * size)()
            n = lc.llama_state_seq_get_data(ctx, buf, size, self.id)
        return ctypes.string_at(buf, n)

    def set_state(self, data: bytes, tokens: Sequence[int]) -> None:
        lc = _llama_cpp()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        self.reset()
        with self.model.lock:
            ok = lc.llama_state_seq_set_data(self.model._ctx, buf, len(data), self.id) != 0
        if not ok:
            raise RuntimeError("llama.cpp refused the sequence state")
        self.tokens = list(tokens)


def row_indices(rows: Sequence[int] | str, n: int) -> list[int]:
    """Which of `n` decoded tokens get logits: "last", "all", "none" or the indices given."""
    if rows == "last":
        return [n - 1]
    if rows == "all":
        return list(range(n))
    if rows == "none":
        return []
    return list(rows)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared prefix; contexts usually differ only near the end, so compare the
    bulk as slices (C speed) and walk only the tail in Python."""
    n = min(len(a), len(b))
    lo = 0
    for probe in (n, n - 64, n - 1024):
        if probe > 0 and a[:probe] == b[:probe]:
            lo = probe
            break
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo


def reuse_point(cached: Sequence[int], tokens: Sequence[int], n_rows: int) -> int:
    """How much of a cache holding `cached` an eval of `tokens` keeps: the common prefix, but never
    the positions whose rows are asked for (their logits must be computed)."""
    return min(common_prefix(cached, tokens), len(tokens) - n_rows)


class _Capture:
    """Reads named graph tensors through llama.cpp's `cb_eval` hook (F32 activations only)."""

    def __init__(self, names: Iterable[str]) -> None:
        lc = _llama_cpp()
        self.names = set(names)
        self.data: dict[str, bytes] = {}
        lib_dir = Path(lc.__file__).parent / "lib"
        candidates = sorted(lib_dir.glob("libggml-base.*")) or sorted(lib_dir.glob("libggml.*"))
        if not candidates:
            raise RuntimeError(f"libggml-base not found in {lib_dir}")
        ggml = ctypes.CDLL(str(candidates[0]))
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_nbytes.restype = ctypes.c_size_t
        ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_tensor_get.restype = None
        ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                 ctypes.c_size_t]
        self._ggml = ggml

        def _on_eval(tensor: ctypes.c_void_p, ask: bool, _user: ctypes.c_void_p) -> bool:
            name = ggml.ggml_get_name(tensor).decode()
            if ask:
                return name in self.names
            if name in self.names:
                size = ggml.ggml_nbytes(tensor)
                buf = ctypes.create_string_buffer(size)
                ggml.ggml_backend_tensor_get(tensor, buf, 0, size)
                self.data[name] = self.data.get(name, b"") + buf.raw
            return True

        self.callback = lc.ggml_backend_sched_eval_callback(_on_eval)

    def begin(self) -> None:
        self.data.clear()

    def result(self, name: str, width: int) -> np.ndarray:
        if name not in self.data:
            raise KeyError(f"tensor {name} was not computed in the last decode")
        return np.frombuffer(self.data[name], dtype=np.float32).reshape(-1, width)
