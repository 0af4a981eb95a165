"""Weight formats: derive a GGUF in the format this CPU's kernels run fastest.

A model ships in one quantization (Q4_K_M for our pair), but which format is fastest depends on
the machine: on x86 llama.cpp repacks only Q4_0, Q4_K and IQ4_NL weights into its gemv/gemm
kernels, while the Q6_K tensors a Q4_K_M file keeps (LM head, half the ffn_down) run a per-token
dot-product loop below 8 tokens (docs/design.md, "Weight formats"). A *variant* is the source
requantized by llama.cpp's own `llama_model_quantize` to one recipe. Requantizing is lossy, so
nothing uses a variant before `quality.py` has measured it against its source.

Variants are written next to their source (or into the model dir), to a `.partial-<pid>` file
first and renamed when complete, named after the source's SHA-256 and the recipe, tagged inside
with both (`via_edge.format.*`), and reused when present.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InvalidParameterError, ModelFileError, ViaEdgeError
from ..files import writable_dir
from ..llama import quantize
from . import catalog
from .catalog import ByteProgress, known_sha256, sha256_cached
from .gguf_info import field_value, open_reader, read_info, scan_header, write_atomically
from .slim import derived_dir, slim_source

SHIPPED = "shipped"
FORMAT_VERSION = 1  # bump when a recipe's meaning changes, so stale variants are not reused


@dataclass(frozen=True)
class Recipe:
    """One llama_model_quantize call: every tensor in `body`, the LM head in `head` if given."""

    name: str
    ftype: str                 # LLAMA_FTYPE_MOSTLY_<ftype>
    body: str                  # the ggml type pure=True gives every quantized tensor
    head: str | None = None    # LM head type (None: the body type; SOURCE_HEAD: the source's own)


SOURCE_HEAD = "source"  # keep the LM head in the source's type (the head decides every logit)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("q4_k", "Q4_K_M", "Q4_K"),                 # the Q4_K tensors copied, the Q6_K ones requantized
    Recipe("q4_0", "Q4_0", "Q4_0"),                   # repacked on x86 and ARM, cheapest single-token path
    Recipe("iq4_nl", "IQ4_NL", "IQ4_NL"),             # non-linear 4-bit, repacked on x86
    Recipe("q4_0-q8head", "Q4_0", "Q4_0", head="Q8_0"),  # Q4_0 body, Q8_0 LM head (more precise logits)
    # AMX kernels cover Q4_0, Q8_0, Q4_K and Q6_K at every batch size (docs/benchmarks.md, section 19)
    Recipe("q8_0", "Q8_0", "Q8_0"),
    Recipe("q4_0-srchead", "Q4_0", "Q4_0", head=SOURCE_HEAD),
    Recipe("q8_0-srchead", "Q8_0", "Q8_0", head=SOURCE_HEAD),
)}
FORMAT_NAMES = (SHIPPED, *RECIPES)
AMX_FORMATS = (SHIPPED, "q4_0", "q4_0-srchead", "q8_0", "q8_0-srchead", "iq4_nl")  # what AMX kernels change
OTHER_FORMATS = (SHIPPED, "q4_k", "q4_0", "iq4_nl", "q4_0-q8head")


def default_formats() -> tuple[str, ...]:
    """The formats the format step tries on this build: with AMX kernels, Q4_0 and Q8_0 (pure and
    with the source's LM head) beside IQ4_NL, which AMX does not run; elsewhere the repacked ones."""
    from ..llama import system_info

    return AMX_FORMATS if "AMX_INT8 = 1" in system_info() else OTHER_FORMATS


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise InvalidParameterError(f"unknown format '{name}'; known: {', '.join(FORMAT_NAMES)}")
    return RECIPES[name]


def check_names(names: list[str] | tuple[str, ...]) -> None:
    for n in names:
        if n != SHIPPED:
            recipe(n)


def variant_path(source: Path, name: str, sha: str) -> Path:
    return derived_dir(source) / f"{source.stem}.{name}-{sha[:12]}.gguf"


def variant_source(path: Path, fresh: bool = False) -> tuple[str, str] | None:
    """(recipe, SHA-256 of the source) for a variant we derived, else None. `fresh`: for a file
    just written, read the header again rather than trust the cache (gguf_info.scan_header)."""
    try:
        fields, _ = scan_header(path, fresh=fresh)  # the header only: this runs on every start
    except ModelFileError:
        return None
    name, sha = fields.get("via_edge.format.recipe"), fields.get("via_edge.format.source_sha256")
    return (name, sha) if name and sha and fields.get("via_edge.format.version") == FORMAT_VERSION else None


def source_file(path: Path) -> Path | None:
    """The file a variant was derived from, where it still is: the catalog model of that SHA-256,
    or a GGUF beside the variant whose remembered SHA-256 is it (a variant is written next to its
    source when that folder is writable). None for a file we did not derive, and for a slim (which
    keeps the format tags of the file it was cut from). Either is taken only while its remembered
    SHA-256 is current (nothing is hashed): a file changed since would not be the source."""
    found = variant_source(path)
    if found is None or slim_source(path):
        return None
    sha = found[1]
    for e in catalog.entries():
        if e.sha256 == sha and (installed := e.installed_path()) is not None and known_sha256(installed) == sha:
            return installed
    return next((p for p in sorted(path.parent.glob("*.gguf")) if p != path and known_sha256(p) == sha), None)


def estimate_size(source: Path, r: Recipe) -> int:
    """Bytes the variant will take: quantized tensors at the recipe's bits per weight, others copied."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    total = 0
    head_name = lm_head(source)
    for t in open_reader(source).tensors:
        if len(t.shape) < 2 or not t.name.endswith(".weight"):  # norms and biases stay F32
            total += int(t.n_bytes)
            continue
        if t.name == head_name and r.head == SOURCE_HEAD:
            total += int(t.n_bytes)
            continue
        kind = T[r.head] if (r.head and t.name == head_name) else T[r.body]
        block, size = GGML_QUANT_SIZES[kind]
        if int(t.shape[0]) % block:  # llama.cpp falls back to another type; assume one as large as Q8_0
            block, size = GGML_QUANT_SIZES[T.Q8_0]
        total += int(t.n_elements) // block * size
    return total + (4 << 20)  # header, vocabulary, alignment


def derive(source: str | os.PathLike, name: str, *, quiet: bool = False, threads: int | None = None) -> Path:
    """The `name` variant of `source`: reused when present and tagged with this source's SHA-256,
    else derived with llama_model_quantize (progress on stderr)."""
    if name == SHIPPED:
        return Path(source)
    r = recipe(name)
    source = Path(source)
    read_info(source)  # missing, foreign or truncated: one clear message before anything else
    sha = sha256_cached(source)
    dest = variant_path(source, name, sha)
    if dest.exists() and variant_source(dest, fresh=True) == (name, sha):
        return dest
    need = estimate_size(source, r)
    writable_dir(dest.parent, f"the {name} variant of {source.name}")
    _remove_stale_partials(dest.parent)
    free = shutil.disk_usage(dest.parent).free
    if free < need + (64 << 20):
        raise ViaEdgeError(f"not enough free disk in {dest.parent} for the {name} variant of {source.name}: "
                           f"needs about {need / 1e6:.0f} MB, {free / 1e6:.0f} MB free")
    tmp = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    progress = ByteProgress(f"deriving {name} of {source.name}", need, quiet)
    try:
        _quantize(source, tmp, r, sha, threads, progress)
        if variant_source(tmp, fresh=True) != (name, sha):
            raise ModelFileError(f"llama.cpp wrote an unreadable {name} variant of {source}")
        tmp.replace(dest)
    finally:
        progress.close()
        tmp.unlink(missing_ok=True)
    return dest


def _quantize(source: Path, tmp: Path, r: Recipe, sha: str, threads: int | None, progress: ByteProgress) -> None:
    """Run llama_model_quantize in a worker thread, so that the main thread can show progress and
    Ctrl-C interrupts at once (the partial file is then removed by the caller)."""
    head = {}
    if r.head:
        name = lm_head(source)
        kind = tensor_types(source)[name] if r.head == SOURCE_HEAD else r.head
        head = {"output_type" if name == "output.weight" else "embedding_type": kind}
    meta = {"via_edge.format.recipe": r.name, "via_edge.format.source_sha256": sha,
            "via_edge.format.version": FORMAT_VERSION}
    failed: list[BaseException] = []

    def work() -> None:
        try:
            quantize(source, tmp, r.ftype, metadata=meta, threads=threads, **head)
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)

    worker = threading.Thread(target=work, name="via-edge-quantize", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.25)
        try:
            size = tmp.stat().st_size
        except OSError:
            size = 0
        progress.update(min(size, progress.total) - progress.done)
    if failed:
        raise ModelFileError(f"llama.cpp could not requantize {source} to {r.name} ({failed[0]}); is the file a "
                             "complete GGUF? `via-edge models pull` re-fetches a damaged catalog model")
    progress.update(progress.total - progress.done)


def _remove_stale_partials(folder: Path) -> None:
    """Partial variants left in `folder` by a killed derivation (their process is gone)."""
    for p in folder.glob("*.gguf.partial-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            continue


def lm_head(path: str | os.PathLike) -> str:
    """The tensor that computes the logits: `output.weight`, or on a tied model the embedding."""
    return "output.weight" if any(t.name == "output.weight" for t in open_reader(path).tensors) else "token_embd.weight"


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> ggml type name, read back with gguf-py."""
    return {t.name: t.tensor_type.name for t in open_reader(path).tensors}


def format_name(path: Path) -> str:
    """A format's short name for reports: a variant's recipe, else the file's own type
    (general.file_type, as llama.cpp names it: Q4_K_M, Q8_0, ...)."""
    from gguf import LlamaFileType

    src = variant_source(path)
    if src:
        return src[0]
    ftype = scan_header(path)[0].get("general.file_type")
    try:
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        types = {t for t in tensor_types(path).values() if t not in ("F32", "F16", "BF16")}
        return "+".join(sorted(types)) or "F32"


def build_f32(source: str | os.PathLike) -> Path:
    """An F32 copy of a quantized GGUF (reused when present), for exact tests and the quick bench.

    Quantized matmuls take different kernels for one token and for a batch, so a batched
    verification can differ from single-token decoding by far more than rounding (SmolLM2 Q4_1:
    up to 0.6 in a logit). With F32 weights (and an F32 KV cache) they agree to ~1e-5, which is
    what makes greedy `sd` reproduce `ar` token for token on a real model.
    """
    import gguf

    source = Path(source)
    scan_header(source)  # a missing or damaged file says so here, before any hashing
    parent = derived_dir(source)
    dest = parent / f"{source.stem}.f32-{sha256_cached(source)[:12]}.gguf"
    if dest.exists():
        return dest  # without gguf-py's reader, which parses the vocabulary for seconds
    writable_dir(parent, f"the F32 copy of {source.name}")
    reader = open_reader(source)
    arch = field_value(reader, "general.architecture")
    tmp = dest.with_name(dest.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for fld in reader.fields.values():
        if fld.name.startswith("GGUF.") or fld.name == "general.architecture":
            continue
        vtype = fld.types[0]
        value = fld.contents()
        if fld.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(fld.name, value, vtype,
                             sub_type=fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    shapes = [tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors]
    for t, shape in zip(reader.tensors, shapes):
        writer.add_tensor_info(t.name, shape, np.float32, int(np.prod(shape)) * 4, gguf.GGMLQuantizationType.F32)
    write_atomically(writer, tmp, dest, (gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                                          .reshape(shape) for t, shape in zip(reader.tensors, shapes)))
    return dest
