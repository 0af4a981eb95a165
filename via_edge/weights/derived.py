"""Files via-edge derives from models (weight formats, slims, F32 copies): found, described and
deleted. Each can be made again from its source, but each costs about as much disk as a model, so
none of them is hidden: `models list` shows them, `models rm` and `models prune` delete them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import ViaEdgeError
from ..tune.store import all_choices
from . import catalog
from .autoformat import all_stored
from .formats import variant_source
from .gguf_info import forget_header
from .slim import format_layers, slim_source

_F32 = re.compile(r"\.f32-([0-9a-f]{12})\.gguf$")


@dataclass(frozen=True)
class Derived:
    path: Path
    kind: str    # "format q4_0", "slim 0-13", "F32 copy"
    source: str  # SHA-256 of the file it was made from (the F32 copy's name keeps 12 digits)
    size: int


def identify(path: Path) -> Derived | None:
    """What `path` is, when via-edge made it (from its own metadata, or the F32 copy's name). A
    slim keeps its source's metadata, a format's included, so it is asked first."""
    try:
        slim = slim_source(path)
    except ViaEdgeError:
        return None
    if slim:
        return Derived(path, f"slim {format_layers(slim[0])}", slim[1], path.stat().st_size)
    found = variant_source(path)
    if found:
        return Derived(path, f"format {found[0]}", found[1], path.stat().st_size)
    m = _F32.search(path.name)
    if m:
        return Derived(path, "F32 copy", m.group(1), path.stat().st_size)
    return None


def derived_files() -> list[Derived]:
    """Every derived GGUF in the model directory and next to the catalog models present."""
    folders = {catalog.model_dir()} | {p.parent for e in catalog.entries() if (p := e.installed_path())}
    found = []
    for folder in sorted(folders):
        for path in sorted(folder.glob("*.gguf")):
            d = identify(path)
            if d is not None:
                found.append(d)
    return found


def source_name(sha: str, files: Sequence[Derived] = ()) -> str:
    """The catalog model a SHA-256 belongs to, or the derived file among `files` (a slim of the
    automatic format is cut from its `q4_0`), for display; else the SHA-256's first digits."""
    for e in catalog.entries():
        if e.sha256.startswith(sha):
            return e.name
    for d in files:
        if (catalog.known_sha256(d.path) or "").startswith(sha):  # remembered when the slim was cut: nothing hashed
            return f"{d.kind.removeprefix('format ')} of {source_name(d.source)}"
    return sha[:12]


def in_use(files: list[Derived]) -> dict[Path, str]:
    """The derived files a stored choice loads: a tuned one (the formats of its pair's models, and
    its slim, cut from the chosen target file) or an automatic format, with what uses each."""
    used: dict[Path, str] = {}
    pairs = catalog.load_catalog()["pairs"]
    for choice in all_choices():
        pair = pairs.get(choice.pair, {})
        target_sha = _sha(pair.get("target"))
        fmt = (f"format {choice.target_format}", target_sha)
        keep = {fmt, (f"format {choice.draft_format}", _sha(pair.get("draft")))}
        if choice.slim_layers:
            cut_from = next((d for d in files if (d.kind, d.source) == fmt), None)
            keep.add((f"slim {choice.slim_layers}", catalog.sha256_cached(cut_from.path) if cut_from else target_sha))
        used.update({d.path: f"tuned {choice.pair}" for d in files if (d.kind, d.source) in keep})
    for auto in all_stored():  # the automatic formats of this machine and build
        used.update({d.path: "automatic format" for d in files
                     if (d.kind, d.source) == (f"format {auto.format}", auto.sha256) and d.path not in used})
    return used


def _sha(name: str | None) -> str | None:
    try:
        return catalog.entry(name).sha256 if name else None
    except ViaEdgeError:
        return None


def remove(path: Path) -> int:
    """Delete a derived file and what remembers its hash and header; the bytes freed."""
    size = path.stat().st_size
    forget_header(path)
    path.unlink()
    path.with_name("." + path.name + ".sha256").unlink(missing_ok=True)
    return size


def find(name: str, files: list[Derived]) -> Derived:
    """A derived file by path or file name; anything else is refused (via-edge deletes only what it made)."""
    for d in files:
        if name in (str(d.path), d.path.name):
            return d
    raise ViaEdgeError(f"{name} is not a file via-edge derived (see `via-edge models list`); "
                       "models you fetched are deleted by hand")
