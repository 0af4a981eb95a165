"""Tuned configurations: what `via-edge tune` chose for a pair on this machine, and where it lives.

Files sit next to the models (`<model dir>/tuned/<pair>--<machine>.{profile,choice}.json`), keyed
by pair and machine, because a choice measured on one CPU says nothing about another. The engine,
`generate`, `chat` and `serve` read the choice as their defaults; every knob can still be overridden.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..decode.spec import SpecParams
from ..errors import ViaEdgeError
from ..files import read_json
from ..machine import machine_key
from ..weights import catalog

log = logging.getLogger("via_edge.tuned")


def tuned_dir() -> Path:
    return catalog.model_dir() / "tuned"


def tuned_path(pair: str, kind: str) -> Path:
    return tuned_dir() / f"{pair}--{machine_key()}.{kind}.json"


@dataclass
class TunedConfig:
    """The tuned choice for one pair: the mode to run and the knobs for every mode."""

    pair: str
    mode: str                                  # the fastest mode meeting the fidelity floor (maybe ar)
    slim_layers: str | None                    # the slim verifier the search found
    modes: dict[str, dict] = field(default_factory=dict)  # mode -> SpecParams fields for that mode
    summary: str = ""                          # one line: what was chosen and why
    target_format: str = "shipped"             # weight format of the target (weights/formats.py recipe)
    draft_format: str = "shipped"              # and of the draft model
    formats: list[str] = field(default_factory=list)  # the formats the tune tried

    def spec(self, mode: str | None = None) -> SpecParams:
        known = {f.name for f in fields(SpecParams)}
        return SpecParams(**{k: v for k, v in self.modes.get(mode or self.mode, {}).items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


def load_choice(pair: str) -> TunedConfig | None:
    """The tuned choice for `pair` on this machine, or None when it was never tuned here."""
    path = tuned_path(pair, "choice")
    if not path.exists():
        others = sorted(p.name for p in tuned_dir().glob(f"{pair}--*.choice.json"))
        if others:
            log.warning("the tuned choice for %s was made on another machine or llama.cpp build (%s), "
                        "not this one (%s); it is not applied: run `via-edge tune --pair %s` here",
                        pair, others[0].split("--", 1)[1].removesuffix(".choice.json"), machine_key(), pair)
        return None
    data = read_json(path)
    try:
        return TunedConfig(**{f.name: data[f.name] for f in fields(TunedConfig) if f.name in data})
    except TypeError as exc:
        raise ViaEdgeError(f"{path} is not a tuned configuration ({exc}); run `via-edge tune` again") from exc


def all_choices() -> list[TunedConfig]:
    """Every stored choice, of any pair, machine or build (what derived files they keep in use)."""
    out = []
    for path in sorted(tuned_dir().glob("*.choice.json")):
        try:
            data = read_json(path)
            out.append(TunedConfig(**{f.name: data[f.name] for f in fields(TunedConfig) if f.name in data}))
        except (ViaEdgeError, TypeError):
            continue  # unreadable: load_choice says so where it matters
    return out
