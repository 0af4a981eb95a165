"""What decoding cost a model or one of its sequences: llama_decode calls, tokens, seconds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelUsage:
    """llama_decode calls, tokens decoded (catch-up and drafts included) and their wall time."""

    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    helped: int = 0  # of those tokens, prompt tokens decoded on the prefill helper (llama/prefill.py)

    def since(self, before: "ModelUsage") -> "ModelUsage":
        return ModelUsage(self.calls - before.calls, self.tokens - before.tokens,
                          self.seconds - before.seconds, self.helped - before.helped)

    def add(self, other: "ModelUsage") -> None:
        self.calls += other.calls
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.helped += other.helped
