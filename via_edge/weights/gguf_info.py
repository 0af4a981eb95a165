"""Facts about a GGUF file, read from its header with gguf-py, without loading the weights.

Also the first line of defence against bad files: a missing, foreign or truncated file is reported
here with one clear message, before llama.cpp gets a chance to print its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ModelFileError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    block_count: int
    context_length: int
    vocab_size: int
    tokenizer_model: str
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    file_size: int
    tied_embeddings: bool


def field_value(reader, key: str):
    """A scalar, string or array metadata value, or None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def open_reader(path: str | os.PathLike):
    """A GGUFReader on a checked file: exists, is a GGUF, and is not truncated.

    Readers are kept per (file, size, mtime): parsing a 150k-token vocabulary takes gguf-py
    seconds, and the slim search derives many files from one target.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"model path is not a file: {path}")
    st = path.stat()
    return _open_reader(path.resolve(), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _open_reader(path: Path, size: int, mtime_ns: int):
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf-py raises assorted errors on damaged headers
        raise ModelFileError(f"GGUF file is corrupt or truncated: {path} ({exc})") from exc
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
    if end > size:
        raise ModelFileError(
            f"GGUF file is truncated: {path} has {size:,} bytes, its tensors need {end:,}"
        )
    return reader


def read_info(path: str | os.PathLike) -> GGUFInfo:
    reader = open_reader(path)
    arch = field_value(reader, "general.architecture")
    if not arch:
        raise ModelFileError(f"GGUF file has no general.architecture: {path}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensor_names = {t.name for t in reader.tensors}
    return GGUFInfo(
        path=Path(path),
        architecture=arch,
        name=field_value(reader, "general.name") or Path(path).stem,
        block_count=int(field_value(reader, f"{arch}.block_count") or 0),
        context_length=int(field_value(reader, f"{arch}.context_length") or 0),
        vocab_size=len(tokens.data) if tokens is not None else 0,
        tokenizer_model=field_value(reader, "tokenizer.ggml.model") or "",
        bos_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        file_size=Path(path).stat().st_size,
        tied_embeddings="output.weight" not in tensor_names,
    )


def write_atomically(writer, tmp: Path, dest: Path, arrays) -> None:
    """Header, metadata, tensor infos, then each array of `arrays`; renamed only when complete."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for array in arrays:
            writer.write_tensor_data(array)
        writer.close()
        tmp.replace(dest)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
