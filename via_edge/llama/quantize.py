"""llama_model_quantize: derived weight formats (weights/formats.py decides which, this only runs it)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Mapping

from .runtime import backend_init, lib


def quantize(source: Path, dest: Path, ftype: str, *, output_type: str | None = None,
             embedding_type: str | None = None, metadata: Mapping[str, str | int] = {},
             threads: int | None = None) -> None:
    """llama_model_quantize: every weight to `ftype`'s base type (pure), requantizing quantized
    ones, the LM head or token embedding to their own types if given, `metadata` written into
    the file's header. Blocks until done; raises RuntimeError on failure."""
    backend_init()
    lc = lib()
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
