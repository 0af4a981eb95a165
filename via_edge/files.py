"""Small files written all or nothing (reports, tuned choices): a reader never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ViaEdgeError


WRITABLE_HINT = "set VIA_EDGE_MODEL_DIR to a writable directory"


def writable_dir(folder: Path, what: str) -> Path:
    """`folder`, created if need be; one clear error when `what` cannot be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ViaEdgeError(f"cannot create {folder} for {what}: {exc.strerror}; {WRITABLE_HINT}") from None
    if not os.access(folder, os.W_OK):
        raise ViaEdgeError(f"{folder} is read-only, so {what} cannot be written there; {WRITABLE_HINT}")
    return folder


def write_text(path: Path, text: str) -> Path:
    writable_dir(path.parent, path.name)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(path: Path, data: dict) -> Path:
    return write_text(path, json.dumps(data, indent=1))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ViaEdgeError(f"{path} is unreadable ({exc}); delete it or run `via-edge tune` again") from exc
