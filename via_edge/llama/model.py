"""One loaded GGUF with one context: load parameters, the vocabulary, and batched decodes.

The context holds one or more KV sequences (`seqs`, one `Seq` per server slot), which decode and
keep their own token bookkeeping; `decode_batch` carries several sequences' tokens in one
llama_decode (the scheduler's continuous batching).

Logits come back as read-only numpy views onto llama.cpp's output buffer (no copy of the
vocabulary per row); a view is valid until the next decode on the same model.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..errors import ContextOverflowError, InvalidParameterError, ModelFileError, RemoteDeviceError
from ..weights.gguf_info import read_info
from . import rpc
from .capture import Capture
from .grammar import GrammarState
from .runtime import backend_init, default_threads, extra_bufts_default, lib, on_compute_thread
from .sequence import Part, Primer, Seq
from .usage import ModelUsage

MAX_SEQ = 64  # sequences per context we accept (llama.cpp's own limit is higher)
_KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type values
_U8P = ctypes.POINTER(ctypes.c_uint8)  # what llama.cpp's state calls take

# What makes a multi-token batch compute exactly what single-token decodes compute (see LoadParams
# and docs/benchmarks.md, "kernels"). Quantized models: no weight repacking, flash attention, and
# batches of at most 7 tokens, within 256 tokens of context (docs/design.md, "Exactness and kernels").
# F32 models: also an F32 KV cache and no flash attention.
EXACT = {"use_extra_bufts": False, "flash_attn": True}
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
    rpc: tuple[str, ...] = ()  # RPC servers (HOST:PORT) that hold a share of the layers (llama/rpc.py)
    tensor_split: tuple[float, ...] = ()  # with rpc: the shares of this machine, then of each server
    embeddings: bool = False   # a context that computes embeddings (`embed`), as llama-cpp-python's embedding=True
    prefill_helper: bool | None = None  # long prompts decoded unrepacked (llama/prefill.py); None: if faster

    def __post_init__(self) -> None:  # checked where the parameters are made: before anything loads
        if self.kv_type not in _KV_TYPES:
            raise InvalidParameterError(f"kv_type must be one of {', '.join(_KV_TYPES)}, got {self.kv_type!r}",
                                        "kv_type")
        if self.prefill_helper and self.rpc:
            raise InvalidParameterError("the prefill helper needs all layers here (no --rpc)", "prefill_helper")

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
        self._remote: rpc.RemoteSplit | None = None
        self.path = Path(path)
        n_block = read_info(self.path).block_count  # clear errors for missing, foreign and truncated files
        backend_init()
        lc = lib()
        self.params = params

        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = params.n_gpu_layers
        mp.use_extra_bufts = params.resolved_extra_bufts()
        self._remote = rpc.RemoteSplit(params.rpc, params.tensor_split, n_block) if params.rpc else None
        if self._remote is not None:
            self._remote.apply(mp)
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
        cp.type_k = cp.type_v = _KV_TYPES[params.kv_type]
        cp.no_perf = True
        cp.embeddings = params.embeddings
        self._capture = Capture(params.capture) if params.capture else None
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
        # fill-in-the-middle tokens the model declares (or llama.cpp recognised by their text): pre, suf,
        # mid, rep, sep; a model without pre, suf and mid cannot fill in the middle
        self.fim = {k: t for k in ("pre", "suf", "mid", "rep", "sep")
                    if (t := getattr(lc, f"llama_vocab_fim_{k}")(self._vocab)) >= 0}
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._logits_ptr_type = ctypes.POINTER(ctypes.c_float)
        self.lock = threading.Lock()  # one llama.cpp call on this context at a time
        self.seqs = [Seq(self, i, self.n_ctx) for i in range(params.n_seq)]
        self.usage = ModelUsage()  # every decode, whichever sequences it carried
        # called after every decode with its parts and seconds, before the sequences take the tokens
        # in (len(seq.tokens) is the context it was decoded on): how tools time decodes
        self.observers: list[Callable[[Sequence[Part], float], None]] = []
        self.prefiller: Primer | None = None  # decodes this model's long prompts (llama/prefill.py), owned

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model once no call is using it (a server's worker may still be decoding)."""
        if getattr(self, "prefiller", None) is not None:
            self.prefiller.close()
            self.prefiller = None
        if not (self._model or self._ctx or self._batch is not None):
            return
        lock = getattr(self, "lock", None)
        if lock is None or sys.is_finalizing():  # half-built, or at exit, where a holder may be frozen
            self._free()
            return
        with lock:
            on_compute_thread(self._free)

    def _free(self) -> None:
        if self._remote is not None and rpc.failure():  # freeing would talk to a dead server: let it go
            self._batch = self._ctx = self._model = None
            return
        lc = lib()
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
        lc = lib()
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
        lc = lib()
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
        return lib().llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(lib().llama_vocab_is_eog(self._vocab, token))

    @property
    def n_remote_layers(self) -> int:
        """Blocks this model keeps on RPC servers (0: all here)."""
        return 0 if self._remote is None else self._remote.n_remote

    def grammar(self, gbnf: str, root: str = "root") -> GrammarState:
        """The start state of a GBNF grammar over this model's vocabulary."""
        return GrammarState(self, self._vocab, gbnf, root)

    def metadata(self) -> dict[str, str]:
        """The GGUF's key-value metadata as strings, as llama.cpp (and llama-cpp-python) report it."""
        lc, out = lib(), {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(lc.llama_model_meta_count(self._model)):
            pair = []
            for read in (lc.llama_model_meta_key_by_index, lc.llama_model_meta_val_str_by_index):
                n = read(self._model, i, buf, len(buf))
                if n >= len(buf):  # a long value (a chat template): read it again whole
                    buf = ctypes.create_string_buffer(n + 1)
                    n = read(self._model, i, buf, len(buf))
                pair.append(buf.value.decode("utf-8", errors="replace"))
            out[pair[0]] = pair[1]
        return out

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """Embeddings of `tokens` (a context made with `embeddings=True`): one pooled vector, or
        one per token when the model pools nothing. One batch at most, as llama-cpp-python asks."""
        if not self.params.embeddings:
            raise InvalidParameterError(f"{self.path.name} was loaded without embeddings=True")
        if not 0 < len(tokens) <= self.n_batch:
            raise ContextOverflowError(f"{len(tokens)} tokens to embed; 1..{self.n_batch} (n_batch) fit")
        lc, b = lib(), self._batch
        self.seqs[0].reset()
        with self.lock:
            for j, tok in enumerate(tokens):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, j, 1, 1
                b.seq_id[j][0] = 0
            b.n_tokens = len(tokens)
            rc, _ = self._compute_decode(b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            if lc.llama_pooling_type(self._ctx) != lc.LLAMA_POOLING_TYPE_NONE:
                out = np.ctypeslib.as_array(lc.llama_get_embeddings_seq(self._ctx, 0), shape=(self.n_embd,)).copy()
            else:
                out = np.stack([np.ctypeslib.as_array(lc.llama_get_embeddings_ith(self._ctx, j), shape=(self.n_embd,))
                                for j in range(len(tokens))])
            self.kv_remove(0, 0)
        return out

    @property
    def chat_template(self) -> str | None:
        raw = lib().llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    # ---- decoding (through `seqs`) ------------------------------------------------------------
    def reset(self) -> None:
        """Empty every sequence's KV cache."""
        with self.lock:
            lib().llama_memory_clear(self._mem, True)
            for seq in self.seqs:
                seq.tokens.clear()

    def decode_batch(self, parts: Sequence[tuple[Seq, Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """One llama_decode of several sequences' tokens: `parts` are (sequence, tokens appended at
        its next positions, row indices into those tokens), at most `n_batch` tokens in all.

        Returns each part's rows as its own array (copied: another part's owner may decode again
        before this one has read them).
        """
        total = sum(len(toks) for _, toks, _ in parts)
        if not 0 < total <= self.n_batch:
            raise ValueError(f"a batch holds 1..{self.n_batch} tokens, got {total}")
        for seq, toks, _ in parts:
            seq.check_room(len(toks))
        # in ascending sequence order: llama.cpp splits a batch of unordered sequences into one
        # ubatch per sequence (measured: 4 sequences x 1 token 172 ms in order, 277-350 ms shuffled)
        order = sorted(range(len(parts)), key=lambda i: parts[i][0].id)
        out: list[np.ndarray] = [None] * len(parts)  # type: ignore[list-item]
        with self.lock:
            logits, seconds = self.run_batch([parts[i] for i in order])
            for seq, toks, _ in parts:
                seq.commit(toks, seconds)
            at = 0
            for i in order:
                n = len(parts[i][2])
                out[i] = np.array(logits[at:at + n])
                at += n
        return out

    def run_batch(self, parts: Sequence[Part]) -> tuple[np.ndarray, float]:
        """Fill the batch, decode: the logits rows in batch order (a view) and the decode's seconds.
        The caller holds the lock and commits each part to its sequence (`Seq.commit`)."""
        if self._batch is None:
            raise RuntimeError(f"{self.path.name} is closed")
        lc = lib()
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
        rc, dt = self._compute_decode(b)
        self.usage.calls += 1
        self.usage.tokens += i
        self.usage.seconds += dt
        if rc != 0:
            # the cache may hold part of the batch: drop it so every `tokens` stays the truth
            for (seq, chunk, _), pos0 in zip(parts, starts):
                self.kv_remove(seq.id, pos0)
            if rc == 1:
                raise ContextOverflowError(f"no KV cache slot for {i} tokens")
            raise RuntimeError(f"llama_decode failed with code {rc}")
        for observe in self.observers:
            observe(parts, dt)
        if not n_rows:
            return np.empty((0, self.n_vocab), dtype=np.float32), dt
        ptr = ctypes.cast(lc.llama_get_logits(self._ctx), self._logits_ptr_type)
        view = np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))
        view.flags.writeable = False
        return view, dt

    # ---- KV cache of one sequence (the caller holds the lock) --------------------------------------
    def kv_remove(self, seq_id: int, start: int) -> None:
        """Drop a sequence's cache from position `start` on."""
        lib().llama_memory_seq_rm(self._mem, seq_id, start, -1)

    # A state is tens of MB (86 MB for 3,000 tokens of the 1.5B target). Through numpy buffers it
    # is not copied in Python, where a ctypes array's zeroing and copies took 140 ms of a 155 ms
    # hand-over; a caller that moves states often passes `into`, a buffer it keeps, whose pages
    # are then faulted in once (docs/benchmarks.md section 65).
    def kv_state_size(self, seq_id: int) -> int:
        return lib().llama_state_seq_get_size(self._ctx, seq_id)

    def kv_state(self, seq_id: int, into: np.ndarray | None = None) -> memoryview:
        """The sequence's state, written into `into` (uint8, at least `kv_state_size` long: the
        caller sized it, so the size is not asked twice) or a new buffer."""
        buf = np.empty(self.kv_state_size(seq_id), dtype=np.uint8) if into is None else into
        n = lib().llama_state_seq_get_data(self._ctx, buf.ctypes.data_as(_U8P), len(buf), seq_id)
        if n == 0:
            raise RuntimeError("llama.cpp could not write the sequence state (buffer too small?)")
        return memoryview(buf[:n]).toreadonly()

    def kv_set_state(self, seq_id: int, data: bytes | memoryview) -> None:
        buf = np.frombuffer(data, dtype=np.uint8)  # no copy: llama.cpp only reads it
        if lib().llama_state_seq_set_data(self._ctx, buf.ctypes.data_as(_U8P), len(buf), seq_id) == 0:
            raise RuntimeError("llama.cpp refused the sequence state")

    def _compute_decode(self, batch) -> tuple[int, float]:
        if self._remote is None:
            return on_compute_thread(self._decode, batch)
        if rpc.failure():
            raise RemoteDeviceError(f"{self.path.name} has layers on an RPC server that failed ({rpc.failure()}); "
                                    "restart with the servers running")
        try:
            return on_compute_thread(self._decode, batch, timeout=rpc.RPC_TIMEOUT)
        except TimeoutError:
            rpc.fail(f"no answer within {rpc.RPC_TIMEOUT:g} s")
            raise RemoteDeviceError(f"an RPC server holding layers of {self.path.name} did not answer within "
                                    f"{rpc.RPC_TIMEOUT:g} s") from None

    def _decode(self, batch) -> tuple[int, float]:
        """llama_decode on the compute thread: its return code and seconds."""
        lc = lib()
        t0 = time.perf_counter()
        rc = lc.llama_decode(self._ctx, batch)
        lc.llama_synchronize(self._ctx)  # Metal computes asynchronously; time the real work
        return rc, time.perf_counter() - t0

    def captured(self, name: str) -> np.ndarray:
        """Rows of an intermediate tensor (e.g. `l_out-3`) from the last decode; needs `capture`."""
        if self._capture is None:
            raise RuntimeError("load with LoadParams(capture=(...)) to read intermediate tensors")
        return self._capture.result(name, self.n_embd)
