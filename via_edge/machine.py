"""What machine this is: the facts every report and the tuned-choice key record."""

from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path

from . import __version__


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads_used": None, "os": platform.platform(),
            "python": platform.python_version()}


def machine_key() -> str:
    """CPU model, core count and the llama.cpp build's features: what decides the costs."""
    from .llama import system_info

    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-")[:40]
    digest = hashlib.sha256(f"{system_info()}|{platform.machine()}".encode()).hexdigest()[:8]
    return f"{slug}-{os.cpu_count()}c-{digest}"


def versions() -> dict:
    from importlib.metadata import version

    out = {"via_edge": __version__}
    for pkg in ("llama-cpp-python", "gguf", "numpy"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out
