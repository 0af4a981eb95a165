"""Derived GGUFs. Mainly the slim verifier's model: a chosen subset of the target's blocks.

llama.cpp cannot skip layers at run time, so intra-model routing is a second, smaller file:
the kept blocks renumbered, plus `token_embd`, `output_norm` and `output` (absent when tied),
with `<arch>.block_count` and every per-layer metadata array sliced to the kept blocks. Tensor
bytes are copied verbatim (quantized weights stay as they are). Written to a `.partial` file and
renamed, named after the target's SHA-256 and the layer set, and reused when present.

Also: slicing the target's KV sequence state so that a prefix slim can import its prompt KV
instead of prefilling the prompt a second time.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from ..errors import LayerSpecError, ModelFileError, ViaEdgeError
from ..files import writable_dir
from .catalog import model_dir
from .catalog import sha256_cached as target_sha256
from .gguf_info import field_value, open_reader, scan_header, write_atomically

# architectures whose layers alternate attention kinds by index (period): renumbering must keep
# every kept block's index modulo the period, or its sliding-window/global kind changes
SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "llama4": 4}
# architectures whose attention scale depends on the model size read off the layer count
SIZE_FROM_LAYERS = {("gemma2", 46), ("gemma3", 62)}
SLIM_FORMAT = 2  # bump when what build_slim writes changes, so stale cached slims are not reused
STATE_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic, heads llama_state_seq_get_data


def parse_layers(spec: str, n_block: int | None) -> tuple[int, ...]:
    """`0-20` or `0-3,14-27` to block indices; strictly increasing, within 0..n_block-1
    (`None`: the syntax alone, before the model's header has been read)."""
    if not spec or not spec.strip():
        raise LayerSpecError("layer set is empty; write it like 0-20 or 0-3,14-27")
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise LayerSpecError(f"bad layer range '{part.strip()}' in '{spec}'; write it like 0-20 or 0-3,14-27")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise LayerSpecError(f"layer range '{part.strip()}' runs backwards")
        for i in range(lo, hi + 1):
            if n_block is not None and i >= n_block:
                raise LayerSpecError(f"layers '{spec}' reach past the model's blocks 0-{n_block - 1} (layer {i} is "
                                     "out of range)")
            if out and i == out[-1]:
                raise LayerSpecError(f"layer {i} appears twice in '{spec}'")
            if out and i < out[-1]:
                if i in out:
                    raise LayerSpecError(f"layer {i} appears twice in '{spec}'")
                raise LayerSpecError(f"layer ranges must be in increasing order: '{spec}'")
            out.append(i)
    return tuple(out)


def format_layers(layers: tuple[int, ...]) -> str:
    """The canonical spec: runs of consecutive blocks, e.g. (0,1,2,5) -> '0-2,5'."""
    parts, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + (None,)):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(parts)


def is_prefix(layers: tuple[int, ...]) -> bool:
    return layers == tuple(range(len(layers)))


def check_supported(arch: str, n_block: int, layers: tuple[int, ...], nextn: int) -> None:
    """Refuse layer sets whose derived model would not compute what the target computes."""
    if (arch, n_block) in SIZE_FROM_LAYERS:
        raise LayerSpecError(f"{arch} with {n_block} blocks takes its attention scale from its size, "
                             "which llama.cpp reads off the block count; a slim of it would change the maths")
    if nextn and any(i >= n_block - nextn for i in layers):
        raise LayerSpecError(f"blocks {n_block - nextn}-{n_block - 1} are multi-token-prediction heads, "
                             "not part of the main model; leave them out of the slim")
    period = SWA_PERIOD.get(arch)
    if period and any(i % period != j % period for j, i in enumerate(layers)):
        raise LayerSpecError(f"{arch} alternates attention kinds every {period} blocks by index; "
                             "keep a prefix or shift by whole periods")


def derived_dir(source: Path) -> Path:
    """Derived files go next to their source, unless that is read-only or inside a Python package."""
    if os.access(source.parent, os.W_OK) and "site-packages" not in source.parts:
        return source.parent
    return model_dir()


def slim_path(target: Path, layers: tuple[int, ...], sha: str) -> Path:
    spec = format_layers(layers).replace(",", "_")
    return derived_dir(target) / f"{target.stem}.slim{SLIM_FORMAT}-{sha[:12]}-L{spec}.gguf"


def build_slim(target: str | os.PathLike, spec: str, out: str | os.PathLike | None = None) -> Path:
    """Write (or reuse) the derived GGUF for `spec`; returns its path."""
    import gguf

    target = Path(target)
    fields, _ = scan_header(target)  # cached: gguf-py's reader parses the vocabulary for seconds (15 s for Qwen's)
    arch = fields.get("general.architecture")
    n_block = int(fields.get(f"{arch}.block_count") or 0)
    if n_block <= 0:
        raise ModelFileError(f"{target} has no {arch}.block_count")
    layers = parse_layers(spec, n_block)
    nextn = int(fields.get(f"{arch}.nextn_predict_layers") or 0)
    check_supported(arch, n_block, layers, nextn)
    sha = target_sha256(target)
    dest = Path(out) if out else slim_path(target, layers, sha)
    if dest.exists():
        if _is_slim_of(dest, layers, sha):
            return dest
        if out is not None:  # never replace a file that is not this very slim, never report it built
            raise ModelFileError(f"{dest} exists and is not the slim {format_layers(layers)} of {target.name}; "
                                 "remove it or choose another --out")
    writable_dir(dest.parent, f"the slim {format_layers(layers)} of {target.name}")
    reader = open_reader(target)
    tmp = dest.with_name(dest.name + ".partial")
    renumber = {old: new for new, old in enumerate(layers)}

    writer = gguf.GGUFWriter(str(tmp), arch)
    align = field_value(reader, "general.alignment")
    if align:
        writer.data_alignment = int(align)
    for fld in reader.fields.values():
        name = fld.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = fld.contents()
        if name == f"{arch}.block_count":
            value = len(layers)
        elif name == f"{arch}.nextn_predict_layers":
            value = 0
        elif name.startswith(f"{arch}.") and sub is not None and len(value) == n_block:
            value = [value[i] for i in layers]  # per-layer array: keep the kept blocks' entries
        elif name == "general.name":
            value = f"{value} slim {format_layers(layers)}"
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.add_key_value("via_edge.slim.layers", format_layers(layers), gguf.GGUFValueType.STRING)
    writer.add_key_value("via_edge.slim.source_blocks", n_block, gguf.GGUFValueType.UINT32)
    writer.add_key_value("via_edge.slim.source_sha256", sha, gguf.GGUFValueType.STRING)

    kept = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.(.+)", t.name)
        if m:
            old = int(m.group(1))
            if old not in renumber:
                continue
            kept.append((f"blk.{renumber[old]}.{m.group(2)}", t))
        else:
            kept.append((t.name, t))
    for name, t in kept:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    write_atomically(writer, tmp, dest, (t.data for _, t in kept))
    return dest


def _is_slim_of(path: Path, layers: tuple[int, ...], sha: str) -> bool:
    try:
        return slim_source(path) == (layers, sha)
    except ViaEdgeError:  # not a GGUF, truncated, or a foreign layer set
        return False


def slim_source(path: str | os.PathLike) -> tuple[tuple[int, ...], str] | None:
    """(kept blocks, SHA-256 of the target it was cut from) for a slim we built, else None. From
    the cached header scan: listing the model directory asks this of every derived file, and
    gguf-py's reader parses each vocabulary for seconds (the tuner's start spent 50 s on it)."""
    fields, _ = scan_header(path)
    spec = fields.get("via_edge.slim.layers")
    n = fields.get("via_edge.slim.source_blocks")
    sha = fields.get("via_edge.slim.source_sha256")
    return (parse_layers(spec, int(n)), sha) if spec and n and sha else None


# ---- KV import -----------------------------------------------------------------------------------
def slice_seq_state(data: bytes | memoryview, keep: int) -> bytes:
    """Keep the first `keep` layers of a single-sequence KV state from `llama_state_seq_get_data`.

    Layout (llama-context.cpp and llama-kv-cache.cpp, state_write): u32 magic 0xaf143cd8,
    i32 seq_id, u32 n_stream; per stream u32 cell_count, the cells
    (i32 pos, u32 n_seq_id, i32 seq_ids...), then u32 v_trans, u32 n_layer, every layer's K rows
    (i32 type, u64 row size, rows), then every layer's V (rows, or transposed with element size).
    """
    off = 0

    def take(fmt: str):
        nonlocal off
        vals = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return vals

    magic, _seq, n_stream = take("IiI")
    if magic != STATE_MAGIC:
        raise ValueError(f"not a llama.cpp sequence state (magic {magic:#x})")
    out = bytearray(data[:off])
    for _ in range(n_stream):
        (cells,) = take("I")
        out += struct.pack("<I", cells)
        if cells == 0:
            continue
        meta_start = off
        for _ in range(cells):
            _pos, n_seq = take("iI")
            if n_seq != 1:
                raise ValueError("KV state slicing supports single-sequence contexts only")
            take("i")
        out += data[meta_start:off]
        v_trans, n_layer = take("II")
        if keep > n_layer:
            raise ValueError(f"cannot keep {keep} of {n_layer} layers")
        out += struct.pack("<II", v_trans, keep)
        for layer in range(n_layer):  # K
            start = off
            _ktype, row = take("iQ")
            off += row * cells
            if layer < keep:
                out += data[start:off]
        for layer in range(n_layer):  # V
            start = off
            if not v_trans:
                _vtype, row = take("iQ")
                off += row * cells
            else:
                _vtype, el, n_embd = take("iII")
                off += el * n_embd * cells
            if layer < keep:
                out += data[start:off]
    if off != len(data):
        raise ValueError(f"unexpected KV state layout ({len(data) - off} trailing bytes)")
    return bytes(out)

