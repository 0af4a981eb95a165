"""Facts about a GGUF file, read from its header without loading the weights.

Also the first line of defence against bad files: a missing, foreign or truncated file is reported
here with one clear message, before llama.cpp gets a chance to print its own.

`read_info` (every command's start-up) scans the header itself and keeps only what it needs: a
vocabulary of 151,936 strings is counted, not decoded, where gguf-py's `GGUFReader` builds an
array per string (seconds on a busy laptop). Code that rewrites GGUFs (slims, formats) uses the
full reader (`open_reader`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ModelFileError, ViaEdgeError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 1024  # longer arrays are kept as their length only


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
    return _open_reader(*_file_key(path))


def _file_key(path: str | os.PathLike) -> tuple[Path, int, int]:
    """(resolved path, size, mtime) of an existing file: what the header caches are keyed by."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"model path is not a file: {path}")
    st = path.stat()
    return path.resolve(), st.st_size, st.st_mtime_ns


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
    fields, tensor_names = scan_header(path)
    arch = fields.get("general.architecture")
    if not arch:
        raise ModelFileError(f"GGUF file has no general.architecture: {path}")
    tokens = fields.get("tokenizer.ggml.tokens")
    return GGUFInfo(
        path=Path(path),
        architecture=arch,
        name=fields.get("general.name") or Path(path).stem,
        block_count=int(fields.get(f"{arch}.block_count") or 0),
        context_length=int(fields.get(f"{arch}.context_length") or 0),
        vocab_size=(tokens if isinstance(tokens, int) else len(tokens)) if tokens is not None else 0,
        tokenizer_model=fields.get("tokenizer.ggml.model") or "",
        bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_id=fields.get("tokenizer.ggml.eos_token_id"),
        chat_template=fields.get("tokenizer.chat_template"),
        file_size=Path(path).stat().st_size,
        tied_embeddings="output.weight" not in tensor_names,
    )


def scan_header(path: str | os.PathLike, fresh: bool = False) -> tuple[dict, frozenset[str]]:
    """A checked file's metadata (scalars and strings as values, arrays as lists, or as their
    length when longer than _SMALL_ARRAY) and its tensor names. Cached by size and mtime, in
    memory and on disk, which a file rewritten within the clock's tick keeps: `fresh` reads it
    again (files via-edge itself writes and checks)."""
    key = _file_key(path)
    return _scan_header(*key) if fresh else _stored_header(*key)


@lru_cache(maxsize=8)
def _stored_header(path: Path, size: int, mtime_ns: int) -> tuple[dict, frozenset[str]]:
    """`_scan_header`, kept in the model directory: skipping a 150k-token vocabulary's strings
    one by one is most of a start-up's own time (docs/benchmarks.md, section 43)."""
    from ..files import write_text

    store = _header_store(path, size, mtime_ns)
    try:
        data = json.loads(store.read_text())
        return data["fields"], frozenset(data["tensors"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fields, tensors = _scan_header(path, size, mtime_ns)
    try:
        text = json.dumps({"path": str(path), "fields": fields, "tensors": sorted(tensors)})
        if json.loads(text)["fields"] == fields:  # only what JSON gives back as it was
            write_text(store, text)
    except (OSError, TypeError, ValueError, ViaEdgeError):
        pass  # read again next time
    return fields, tensors


def _header_store(path: Path, size: int, mtime_ns: int) -> Path:
    from .catalog import model_dir

    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()[:24]
    return model_dir() / "headers" / f"{digest}.json"


def forget_header(path: str | os.PathLike) -> None:
    """Drop a file's kept header scan (before the file is deleted: the scan is keyed by its size
    and mtime)."""
    _header_store(*_file_key(path)).unlink(missing_ok=True)


def _scan_header(path: Path, size: int, mtime_ns: int) -> tuple[dict, frozenset[str]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            f.seek(0)
            raise ModelFileError(f"not a GGUF file (bad magic {f.read(4)!r}): {path}")
        try:
            header = _Header(f)
            version, n_tensors, n_kv = header.unpack("<IQQ")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            fields = {}
            for _ in range(n_kv):
                key = header.string()
                fields[key] = header.value(header.unpack("<I")[0])
            end = 0
            names = []
            for _ in range(n_tensors):
                names.append(header.string())
                n_dims = header.unpack("<I")[0]
                dims = header.unpack(f"<{n_dims}Q")
                kind, offset = header.unpack("<IQ")
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                count = 1
                for d in dims:
                    count *= d
                end = max(end, offset + count // block * type_size)
            align = int(fields.get("general.alignment") or 32)
            data_offset = -(-header.tell() // align) * align
        except (struct.error, ValueError, KeyError, UnicodeDecodeError, MemoryError) as exc:
            raise ModelFileError(f"GGUF file is corrupt or truncated: {path} ({exc})") from exc
    if data_offset + end > size:
        raise ModelFileError(f"GGUF file is truncated: {path} has {size:,} bytes, its tensors need "
                             f"{data_offset + end:,}")
    return fields, frozenset(names)


class _Header:
    """Sequential little-endian reads through a GGUF header (buffered; no per-string arrays)."""

    def __init__(self, f) -> None:
        self.f = f

    def tell(self) -> int:
        return self.f.tell()

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("the header ends early")
        return data

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def string(self) -> str:
        return self.read(self.unpack("<Q")[0]).decode("utf-8")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.unpack("<IQ")
        if count <= _SMALL_ARRAY:
            return [self.value(item) for _ in range(count)]
        if item in _SCALARS:  # fixed size: skip it whole
            self.f.seek(count * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
        elif item == _STRING:  # each string says its length: walk them, decode none
            read, skip = self.f.read, self.f.seek
            for _ in range(count):
                (n,) = struct.unpack("<Q", read(8))
                skip(n, os.SEEK_CUR)
        else:
            for _ in range(count):
                self.value(item)
        return count


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
