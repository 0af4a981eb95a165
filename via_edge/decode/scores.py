"""The narrow interface between the decoding policy and a model: scores for the rows of one eval.

The decoding loop asks a model only for what it decides with (the argmax, the routing ratio
p(d)/max p, the top probability, the sampling distribution), each computed when asked and in
float32. `ScoredModel` answers from llama.cpp's logits; the tuner's replay answers the same
questions from recorded traces (`tune/replay.py`), so both drive one `Decoder`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..llama import LlamaModel
from .sampling import Dist, SamplingParams, dist, ratio_to_top, top_prob


class Rows(Protocol):
    """Row i predicts the token after position len(tokens) - len(rows) + i of the eval's tokens."""

    def __len__(self) -> int: ...
    def argmax(self, i: int) -> int: ...
    def ratio(self, i: int, token: int) -> float: ...        # p(token) / max p, untempered
    def top_prob(self, i: int) -> float: ...                 # max p, untempered
    def dist(self, i: int, sp: SamplingParams) -> Dist: ...  # what `sp` samples from
    def logprobs(self, i: int, token: int, n: int) -> "TokenLogprobs": ...  # asked only when logprobs are


class Scorer(Protocol):
    """A model as the decoding policy sees it (see `LlamaModel.eval` for the KV contract)."""

    n_ctx: int
    tokens: list[int]  # what its KV cache holds

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> Rows: ...
    def decode(self, tokens: Sequence[int]) -> Rows: ...      # append; the last row
    def is_eog(self, token: int) -> bool: ...


class Decodes(Protocol):
    """What decodes a sequence: llama.Seq, or batching.BatchedSeq when slots share the model."""

    n_ctx: int
    tokens: list[int]

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> np.ndarray: ...
    def decode(self, tokens: Sequence[int], rows: Sequence[int] | str = "last") -> np.ndarray: ...
    def prefill(self, tokens: Sequence[int]) -> None: ...


class LogitRows:
    """Scores over float32 logits rows (a view valid until the model's next decode)."""

    __slots__ = ("logits",)

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def __len__(self) -> int:
        return len(self.logits)

    def argmax(self, i: int) -> int:
        return int(self.logits[i].argmax())

    def ratio(self, i: int, token: int) -> float:
        return ratio_to_top(self.logits[i], token)

    def top_prob(self, i: int) -> float:
        return top_prob(self.logits[i])[1]

    def dist(self, i: int, sp: SamplingParams) -> Dist:
        return dist(self.logits[i], sp)

    def logprobs(self, i: int, token: int, n: int) -> TokenLogprobs:
        return token_logprobs(self.logits[i], token, n)


TokenLogprobs = tuple[int, float, list[tuple[int, float]]]  # token, log p(token), the n likeliest (id, log p)


def token_logprobs(row: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """Log-probabilities of `token` and of the row's `n` likeliest tokens: the softmax of the row
    (after logit_bias and penalties, before sampling filters and grammar, as OpenAI reports them)."""
    x = np.asarray(row, dtype=np.float32)
    top = x.max()
    lse = float(top) + float(np.log(np.exp(x - top).sum(dtype=np.float64)))
    best: list[tuple[int, float]] = []
    if n:
        ids = np.argpartition(x, x.size - n)[x.size - n:]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = [(int(t), float(x[t]) - lse) for t in ids]
    return token, float(x[token]) - lse, best


class ScoredModel:
    """A `LlamaModel` behind the `Scorer` interface, with end-of-generation looked up once per token.

    Decodes go through `seq`: one of the model's `Seq`s (default: the first), or a
    `batching.BatchedSeq` when concurrent generations share the model.
    """

    def __init__(self, model: LlamaModel, seq: "Decodes | None" = None) -> None:
        self.model = model
        self.seq = seq if seq is not None else model.seqs[0]
        self.n_ctx = self.seq.n_ctx
        self._eog: dict[int, bool] = {}

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens

    def eval(self, tokens: Sequence[int], n_rows: int = 1) -> LogitRows:
        return LogitRows(self.seq.eval(tokens, n_rows))

    def decode(self, tokens: Sequence[int]) -> LogitRows:
        return LogitRows(self.seq.decode(tokens))

    def is_eog(self, token: int) -> bool:
        hit = self._eog.get(token)
        if hit is None:
            hit = self._eog[token] = self.model.is_eog(token)
        return hit
