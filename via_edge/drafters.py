"""Drafters: propose up to k tokens after a context, with the probabilities they were drawn from.

One small interface (as llama.cpp's `common/speculative.cpp`): `propose(context, k, ...)`.
`Draft.conf[i]` is the drafter's own (untempered) probability of token i, the `draft` routing
score; `p_min` (passed per call from SpecParams) looks at the probability of the top candidate before
a token is added; `Draft.q[i]` is the full distribution token i was sampled from,
kept only when sampling, because the lossless acceptance rule needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from .errors import IncompatibleModelsError, InvalidParameterError
from .llama import LlamaModel
from .sampling import SamplingParams, sample
from .scores import Scorer


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # per token, when asked for (`draft` routing)
    q: list[np.ndarray] | None = None  # per token, when sampling

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator, *,
                p_min: float = 0.0, n_min: int = 0, conf: bool = False) -> Draft: ...


class ModelDrafter:
    """A small GGUF with its own KV cache, kept in sync with the context by prefix reuse.

    The top probability is computed only where something reads it (p_min, or `conf` for routing
    on the draft's confidence): it is a full pass over the vocabulary per token.
    """

    def __init__(self, model: Scorer) -> None:
        self.model = model

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator, *,
                p_min: float = 0.0, n_min: int = 0, conf: bool = False) -> Draft:
        draft = Draft(q=None if sp.greedy else [])
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return draft
        rows = self.model.eval(context, 1)
        for i in range(k):
            best = rows.argmax(0)
            p_best = rows.top_prob(0) if conf or (p_min > 0 and i >= n_min) else 1.0
            if i >= n_min and p_best < p_min:
                break
            if sp.greedy:
                tok = best
                p_tok = p_best
            else:
                q = rows.dist(0, sp)
                tok = sample(q, rng)
                draft.q.append(q)
                p_tok = p_best * rows.ratio(0, tok) if conf else 1.0
            draft.tokens.append(tok)
            if conf:
                draft.conf.append(p_tok)
            if i + 1 == k or self.model.is_eog(tok):
                break
            rows = self.model.decode([tok])
        return draft


class PromptLookupDrafter:
    """Continues the latest earlier occurrence of the context's last n-gram (no model call).

    Tries n from `ngram_max` down to `ngram_min`; the proposal is deterministic, so its
    distribution is a point mass (q = one-hot), conf is 1 and p_min/n_min do not apply.
    """

    def __init__(self, n_vocab: int, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise InvalidParameterError("need 1 <= ngram_min <= ngram_max")
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator, *,
                p_min: float = 0.0, n_min: int = 0, conf: bool = False) -> Draft:
        draft = Draft(q=None if sp.greedy else [])
        toks = context if isinstance(context, list) else list(context)
        n = len(toks)
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            pattern = toks[n - size:]
            for start in range(n - size - 1, -1, -1):
                if toks[start:start + size] == pattern:
                    draft.tokens = toks[start + size:start + size + k]
                    break
            if draft.tokens:
                break
        if conf:
            draft.conf = [1.0] * len(draft.tokens)
        if draft.q is not None:
            draft.q = [_one_hot(t, self.n_vocab) for t in draft.tokens]
        return draft


def _one_hot(token: int, n_vocab: int) -> np.ndarray:
    q = np.zeros(n_vocab, dtype=np.float32)
    q[token] = 1.0
    return q


def check_compatible(target: LlamaModel, other: LlamaModel, role: str) -> None:
    """llama.cpp's rule for draft/target pairs, with the first difference named."""
    where = f"{role} {other.path.name} vs target {target.path.name}"
    if target.vocab_type != other.vocab_type:
        raise IncompatibleModelsError(f"{where}: vocabulary types differ ({other.vocab_type} vs {target.vocab_type})")
    if target.add_bos != other.add_bos or (target.add_bos and target.bos != other.bos):
        raise IncompatibleModelsError(f"{where}: BOS handling differs (add_bos {other.add_bos}, bos "
                                      f"{other.bos} vs add_bos {target.add_bos}, bos {target.bos})")
    if target.eos != other.eos:
        raise IncompatibleModelsError(f"{where}: EOS token differs ({other.eos} vs {target.eos})")
    if abs(target.n_vocab - other.n_vocab) > 128:
        raise IncompatibleModelsError(f"{where}: vocabulary sizes differ by more than 128 "
                                      f"({other.n_vocab} vs {target.n_vocab})")
    for t in range(5, min(target.n_vocab, other.n_vocab)):
        if target.token_text(t) != other.token_text(t):
            raise IncompatibleModelsError(f"{where}: token {t} differs "
                                          f"({other.token_text(t)!r} vs {target.token_text(t)!r})")
