"""What machine this is: the facts every report and the tuned-choice key record."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
from pathlib import Path

from .version import VERSION


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def build() -> dict:
    """The llama.cpp build in use: its flavor (amx, noamx, native), where that was learnt, and
    the features llama.cpp reports. tools/install.sh records the flavor and its self-check in the
    environment; otherwise it is inferred from the features and the CPU."""
    from .llama import system_info

    info = system_info()
    features = sorted(k.strip() for part in info.split("|") if "=" in part
                      for k, v in [part.split(":")[-1].split("=")] if v.strip() == "1")
    try:
        recorded = json.loads((Path(sys.prefix) / "via-edge-build.json").read_text())
    except (OSError, ValueError):
        recorded = {}
    if recorded.get("flavor"):
        return {"flavor": recorded["flavor"], "source": "tools/install.sh", "features": features,
                "self_check": recorded.get("self_check", "not run")}
    flavor = "amx" if "AMX_INT8" in features else "noamx" if has_amx() else "native"
    return {"flavor": flavor, "source": "inferred", "features": features, "self_check": "not run"}


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

    out = {"via_edge": VERSION}
    for pkg in ("llama-cpp-python", "gguf", "numpy"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out
