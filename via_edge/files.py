"""Small files written all or nothing (reports, tuned choices): a reader never sees half a file."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ViaEdgeError


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
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
