"""Intermediate tensors of a decode, read through llama.cpp's `cb_eval` hook."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Iterable

import numpy as np

from .runtime import lib


class Capture:
    """Reads named graph tensors through llama.cpp's `cb_eval` hook (F32 activations only)."""

    def __init__(self, names: Iterable[str]) -> None:
        lc = lib()
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
