"""llama.cpp's grammar sampler as a state: which tokens may come next, advanced token by token.

llama.cpp aborts the process when a grammar accepts a token it does not allow (an empty stack
after the piece, or an end-of-generation token before the grammar is complete), so `accept`
checks first and raises instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

import numpy as np

from ..errors import InvalidParameterError
from .runtime import backend_init, lib, log

# llama_token_data {int32 id; float logit; float p}: a numpy array of these is the C array
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Printed:
    text = ""


_stderr_lock = threading.Lock()


@contextlib.contextmanager
def _stderr_captured() -> Iterator[_Printed]:
    """What C code prints to file descriptor 2 meanwhile (llama.cpp's grammar parser reports its
    errors with fprintf(stderr), where a server's client would never see them)."""
    out = _Printed()
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.text = tmp.read().decode("utf-8", errors="replace")


class GrammarState:
    """One position of a GBNF grammar over a model's vocabulary (free with `close`, or let it go)."""

    def __init__(self, model, vocab, gbnf: str = "", root: str = "root", *, _ptr=None) -> None:
        self._model, self._vocab = model, vocab  # the grammar reads the vocabulary: keep its model alive
        if _ptr is not None:
            self._ptr = _ptr
            return
        backend_init()
        collect, level = _Collect(), log.level
        log.addHandler(collect)
        log.setLevel(logging.DEBUG)  # llama.cpp logs some grammar errors...
        try:
            with _stderr_captured() as printed:  # ...and prints the parser's own message to stderr
                self._ptr = lib().llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
        finally:
            log.removeHandler(collect)
            log.setLevel(level)
        if not self._ptr:
            found = re.search(r"error parsing grammar: (.*)", printed.text)
            where = found.group(1).strip() if found else next(
                (line.strip() for line in collect.lines if "parse" in line.lower() or "error" in line.lower()), "")
            raise InvalidParameterError("the grammar does not parse as GBNF" + (f": {where}" if where else ""))

    def clone(self) -> "GrammarState":
        return GrammarState(self._model, self._vocab, _ptr=lib().llama_sampler_clone(self._ptr))

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """A bool per token id: may it come next?"""
        data = np.zeros(len(ids), dtype=TOKEN_DATA)
        data["id"] = ids
        self._apply(data)
        return np.isfinite(data["logit"])

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of a full-vocabulary logits row with every token the grammar forbids at -inf."""
        data = np.empty(len(logits), dtype=TOKEN_DATA)
        data["id"] = np.arange(len(logits), dtype=np.int32)
        data["logit"] = logits
        data["p"] = 0.0
        self._apply(data)
        return data["logit"]

    def accept(self, token: int) -> None:
        if not self.allowed(np.array([token], dtype=np.int32))[0]:
            raise ValueError(f"token {token} is not allowed by the grammar here")
        lib().llama_sampler_accept(self._ptr, token)

    def _apply(self, data: np.ndarray) -> None:
        lc = lib()
        arr = lc.llama_token_data_array(data.ctypes.data_as(lc.llama_token_data_p), len(data), -1, False)
        lc.llama_sampler_apply(self._ptr, ctypes.byref(arr))

    def close(self) -> None:
        if self._ptr:
            lib().llama_sampler_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
