"""Figures for the reports, drawn on `matplotlib.figure.Figure` rather than pyplot: no backend to
choose, no global state to close, safe from any thread. matplotlib is optional; without it the
reports are written without their pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def figure(**kwargs: Any) -> Any | None:
    """A new Figure (`Figure(**kwargs)`), or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(**kwargs)


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
