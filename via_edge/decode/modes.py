"""The decoding modes, declared once: which models each needs, whether its output is the target's,
and which round of the decoding loop runs it. Engine, decoding loop, bench and tune all read this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidParameterError

Mode = Literal["ar", "sd", "lookup", "via", "hier"]
Origin = Literal["draft", "copy", "slim", "target"]  # who produced a committed token (copy: the context)
Tier = Literal["A", "B", "C"]                # what decided it: routing alone, the slim, the target
Drafting = Literal["model", "lookup"]

DRAFT: Origin = "draft"
COPY: Origin = "copy"
SLIM: Origin = "slim"
TARGET: Origin = "target"


@dataclass(frozen=True)
class ModeInfo:
    drafter: Drafting | None  # what proposes tokens (None: nothing, the target decodes alone)
    slim: bool                # needs the slim verifier
    lossless: bool            # output is the target's (greedy: token for token)
    rounds: str               # the Decoder round that runs it
    about: str

    @property
    def draft_model(self) -> bool:
        return self.drafter == "model"


MODES: dict[str, ModeInfo] = {
    "ar": ModeInfo(None, False, True, "ar", "the target alone, one token per call"),
    "sd": ModeInfo("model", False, True, "sd", "draft model proposes, target verifies"),
    "lookup": ModeInfo("lookup", False, True, "sd", "sd with drafts copied from the context (copy-aware)"),
    "via": ModeInfo("model", True, False, "via", "three tiers routed by the slim (lossy)"),
    "hier": ModeInfo("model", True, True, "hier", "slim filters and extends drafts, target verifies"),
}
MODE_NAMES: tuple[str, ...] = tuple(MODES)
# The mode generate, chat, serve and the Python API run when no tuned choice names one: copy-aware
# drafting costs nothing where the answer copies nothing (it drafts only when a copy pays, else the
# round is plain decoding) and is several times faster where it does (docs/benchmarks.md, section 20).
DEFAULT_MODE = "lookup"
LOSSLESS: frozenset[str] = frozenset(m for m, info in MODES.items() if info.lossless)


def mode_info(mode: str) -> ModeInfo:
    try:
        return MODES[mode]
    except KeyError:
        raise InvalidParameterError(f"mode must be one of {', '.join(MODES)}, got {mode!r}") from None


def check_logprobs(mode: str, logprobs: int | None) -> None:
    """Logprobs come from the target's row of every token: lossless modes have one (the target
    verifies every token), `via` commits some the target never saw."""
    if logprobs is not None and not mode_info(mode).lossless:
        raise InvalidParameterError(f"logprobs need the target's row of every token, and mode {mode} commits some "
                                    f"without the target: use {', '.join(sorted(LOSSLESS))}", "logprobs")
