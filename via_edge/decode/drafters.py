"""Drafters: propose up to k tokens after a context, with the probabilities they were drawn from.

One small interface, llama.cpp's `common/speculative.cpp` shape: `begin(prompt)` once per generation,
`propose(context, k, sp, rng, spec)` each round (reading the knobs of `spec` that concern it), then
`accept(n)`: how many of the proposed tokens the committed context kept. `Draft.conf[i]` is the
drafter's own (untempered) probability of token i, the `draft` routing score; `Draft.q[i]` is the
distribution token i was sampled from, kept only when sampling because the lossless acceptance
rule needs it (None: a point mass on the token, as a copy is). `Draft.origin` says who the draft
tokens came from (a draft model, or a copy) and `Draft.source` what a copy copies: the context,
the request's prediction (OpenAI's Predicted Outputs) or the engine's copy memory. `begin` takes
those extra copy sources; only copy drafting (decode/copying.py) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ..errors import IncompatibleModelsError
from ..llama import LlamaModel
from .modes import DRAFT, Origin
from .sampling import Dist, SamplingParams
from .scores import Scorer
from .spec import SpecParams

if TYPE_CHECKING:
    from .constraints import Constraint
    from .sources import CopySource


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # per token, when asked for (`draft` routing)
    q: list[Dist | None] | None = None  # per token, when sampling (None: point mass)
    origin: Origin = DRAFT
    source: str = ""  # a copy's source: "context", "prediction" or "memory"

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    """Proposes up to k tokens after `context`; with a `constraint`, only tokens its grammar allows
    (a forbidden one would only be rejected). Within one generation (after `begin`) each context
    extends the previous one: the loop only appends what it commits."""

    def begin(self, prompt: Sequence[int], sources: Sequence["CopySource"] = ()) -> None: ...

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator,
                spec: SpecParams, *, conf: bool = False, constraint: "Constraint | None" = None) -> Draft: ...

    def accept(self, n_accepted: int) -> None: ...


class ModelDrafter:
    """A small GGUF with its own KV cache, kept in sync with the context by prefix reuse.

    The top probability is computed only where something reads it (p_min, or `conf` for routing
    on the draft's confidence): it is a full pass over the vocabulary per token.
    """

    def __init__(self, model: Scorer) -> None:
        self.model = model

    def begin(self, prompt: Sequence[int], sources: Sequence["CopySource"] = ()) -> None:
        """Nothing to do: its KV cache follows the context by prefix reuse at each call."""

    def accept(self, n_accepted: int) -> None:
        """Nothing to learn: rejected tokens leave its cache at the next call's prefix check."""

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator,
                spec: SpecParams, *, conf: bool = False, constraint: "Constraint | None" = None) -> Draft:
        draft = Draft(q=None if sp.greedy else [])
        p_min, n_min = spec.p_min, spec.n_min
        k = min(k, spec.n_draft, self.model.n_ctx - len(context))
        if k <= 0:
            return draft
        rows = self.model.eval(context, 1)
        for i in range(k):
            if constraint is not None:  # the draft's own choice among what the grammar allows
                rows = constraint.rows(rows, context, after=draft.tokens)
            best = rows.argmax(0)
            p_best = rows.top_prob(0) if conf or (p_min > 0 and i >= n_min) else 1.0
            if i >= n_min and p_best < p_min:
                break
            if sp.greedy:
                tok = best
                p_tok = p_best
            else:
                q = rows.dist(0, sp)
                tok = q.sample(rng)
                draft.q.append(q)
                p_tok = p_best * rows.ratio(0, tok) if conf else 1.0
            draft.tokens.append(tok)
            if conf:
                draft.conf.append(p_tok)
            if i + 1 == k or self.model.is_eog(tok):
                break
            rows = self.model.decode([tok])
        return draft


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
