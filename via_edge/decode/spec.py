"""The speculation knobs of every mode and drafter, with their limits: a leaf module, so the decoding
loop, the drafters, the tuner and the CLI all read one definition and none imports another for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidParameterError

ROUTES = ("slim", "draft", "both")  # what the via tier's routing score is read from
NGRAM_LIMIT = 16  # longest n-gram the copy index keeps: longer anchors add nothing a run does not say


def _knob(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SpecParams:
    """Speculation knobs, validated once; defaults are sane for a 2-core CPU (see docs/design.md).

    Each field's help text is the CLI's: the options of generate, chat, serve and bench are made
    from these fields.
    """

    n_draft: int = _knob(6, "Draft-model tokens per round (llama.cpp --draft-max).")
    tau_accept: float = _knob(0.9, "via: keep a draft token at or above this routing score.")
    tau_full: float = _knob(0.3, "via: send to the target below this score (>1: always); hier: cut the block there.")
    route: str = _knob("slim", "via: routing score from slim, draft or both.")
    max_lag: int = _knob(32, "via: the target verifies at least every this many tokens (0: never forced).")
    hier_block: int = _knob(12, "hier: tokens per target verification.")
    p_min: float = _knob(0.0, "Stop drafting when the draft's top probability is below this.")
    n_min: int = _knob(0, "Draft at least this many tokens before p_min applies.")
    copy_max: int = _knob(63, "lookup: longest copied draft (63: a 64-row verification); each round drafts "
                              "0..this, chosen from the copy's record and the target's batch costs.")
    ngram_min: int = _knob(1, "lookup: shortest repeat of the context's end that anchors a copy.")
    ngram_max: int = _knob(12, f"lookup: longest repeat looked for (at most {NGRAM_LIMIT}).")

    def __post_init__(self) -> None:
        if not 1 <= self.n_draft <= 64:
            raise InvalidParameterError(f"n_draft must be in 1..64, got {self.n_draft}")
        if not 0 <= self.tau_accept <= 1:
            raise InvalidParameterError(f"tau_accept must be in [0, 1], got {self.tau_accept}")
        if not 0 <= self.tau_full <= 2:
            raise InvalidParameterError(f"tau_full must be in [0, 2] (above 1: every token to the target), "
                                        f"got {self.tau_full}")
        if self.tau_full > self.tau_accept and self.tau_full <= 1:
            raise InvalidParameterError(f"tau_full ({self.tau_full}) must not exceed tau_accept "
                                        f"({self.tau_accept})")
        if self.route not in ROUTES:
            raise InvalidParameterError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.max_lag < 0:
            raise InvalidParameterError(f"max_lag must be >= 0 (0 = unbounded), got {self.max_lag}")
        if not 0 <= self.p_min <= 1:
            raise InvalidParameterError(f"p_min must be in [0, 1], got {self.p_min}")
        if self.n_min < 0:
            raise InvalidParameterError(f"n_min must be >= 0, got {self.n_min}")
        if not 1 <= self.copy_max <= 64:
            raise InvalidParameterError(f"copy_max must be in 1..64, got {self.copy_max}")
        if not 1 <= self.ngram_min <= self.ngram_max <= NGRAM_LIMIT:
            raise InvalidParameterError(f"need 1 <= ngram_min <= ngram_max <= {NGRAM_LIMIT}, got "
                                        f"ngram_min {self.ngram_min}, ngram_max {self.ngram_max}")
        if not 2 <= self.hier_block <= 128:
            raise InvalidParameterError(f"hier_block must be in 2..128, got {self.hier_block}")
