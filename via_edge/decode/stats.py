"""Decoding statistics, named like llama.cpp's where they overlap (`draft_n`, `draft_n_accepted`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..llama.usage import ModelUsage
from .modes import COPY, DRAFT, SLIM, Origin, Tier


@dataclass
class Stats:
    """Counters for one generation; `+=` merges them into session totals.

    Tiers (VIA-SD): A = draft token accepted on the routing score alone, B = token decided by the
    slim verifier, C = token decided by the full target. In `sd`/`hier` every token is tier C.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    draft_n: int = 0              # tokens proposed by the drafter
    draft_n_accepted: int = 0     # proposed tokens that were committed (any tier)
    draft_rounds: int = 0         # rounds in which the drafter proposed anything
    copied_tokens: int = 0        # committed draft tokens that were copies (of the context, a prediction, the memory)
    prediction_draft_n: int = 0   # draft tokens copied from the request's prediction
    prediction_draft_n_accepted: int = 0
    memory_draft_n: int = 0       # draft tokens copied from the engine's copy memory
    memory_draft_n_accepted: int = 0
    prediction_accepted: int = 0  # prediction tokens that appear in the answer (OpenAI's accepted_prediction_tokens)
    prediction_rejected: int = 0  # ... and those that do not (its rejected_prediction_tokens)
    tier_a: int = 0               # accepted without any verifier (routing score >= tau_accept)
    tier_b: int = 0               # decided by the slim verifier
    tier_b_replaced: int = 0      # ... of which the slim replaced the draft token
    tier_c: int = 0               # decided by the target (accepted drafts + its own tokens)
    target_tokens: int = 0        # tokens emitted by the target itself (corrections and bonuses)
    queue_seconds: float = 0.0    # waiting for a free slot (server queue included)
    cache_tokens: int = 0         # prompt tokens found in the slot's KV cache (not prefilled again)
    prefilled_tokens: int = 0     # prompt tokens the target decoded before the first round
    first_from_prompt: int = 0    # 1 when the prompt's decode gave the first token (one slot), 0 under slots
    prefill_seconds: float = 0.0
    generate_seconds: float = 0.0
    draft: ModelUsage = field(default_factory=ModelUsage)
    slim: ModelUsage = field(default_factory=ModelUsage)
    target: ModelUsage = field(default_factory=ModelUsage)

    def count(self, origin: Origin, tier: Tier) -> None:
        """Account for one committed token: who produced it and which tier decided it."""
        self.generated_tokens += 1
        if tier == "A":
            self.tier_a += 1
        elif tier == "B":
            self.tier_b += 1
            self.tier_b_replaced += origin == SLIM  # the slim only emits tokens of its own in tier B
        else:
            self.tier_c += 1
        if origin == DRAFT or origin == COPY:
            self.draft_n_accepted += 1
            self.copied_tokens += origin == COPY
        elif origin != SLIM:
            self.target_tokens += 1

    def copied_from(self, source: str, drafted: int, accepted: int) -> None:
        """Account for draft tokens copied from a prediction or the copy memory."""
        if source == "prediction":
            self.prediction_draft_n += drafted
            self.prediction_draft_n_accepted += accepted
        elif source == "memory":
            self.memory_draft_n += drafted
            self.memory_draft_n_accepted += accepted

    @property
    def rejected(self) -> int:
        return self.draft_n - self.draft_n_accepted

    @property
    def rejection_rate(self) -> float:
        return self.rejected / self.draft_n if self.draft_n else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.draft_n_accepted / self.rounds if self.rounds else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Tokens per proposed draft: the length the drafter (or the copy policy) chose."""
        return self.draft_n / self.draft_rounds if self.draft_rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        """Prompt tokens the prefill decoded per second, as llama-server counts them: not those
        found in the cache, which cost nothing; all the others with one slot (the prompt's decode
        gives the first token), all but the last under slots (the first round decodes it)."""
        n = self.prefilled_tokens
        return n / self.prefill_seconds if self.prefill_seconds and n > 0 else 0.0

    def __iadd__(self, other: "Stats") -> "Stats":
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, ModelUsage):
                mine.add(theirs)
            else:
                setattr(self, f.name, mine + theirs)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            rejected=self.rejected,
            rejection_rate=round(self.rejection_rate, 4),
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted_per_round=round(self.mean_accepted_per_round, 3),
            mean_draft_length=round(self.mean_draft_length, 3),
            tokens_per_second=round(self.tokens_per_second, 3),
            prompt_tokens_per_second=round(self.prompt_tokens_per_second, 3),
        )
        return d
