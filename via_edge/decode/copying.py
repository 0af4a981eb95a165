"""Copy-aware drafting (`lookup`): what comes next in a copy of earlier text, drafted as long as
the copy has proven reliable and the target's batch costs make it pay.

The copy comes from the context (the prompt, earlier turns, the answer so far) or from copy
sources beside it: a request's prediction (OpenAI's Predicted Outputs) or the engine's copy
memory (decode/memory.py). `NgramIndex` finds where the context's end occurred before,
`CopyPolicy` picks each draft's length from acceptance learned per run length, `CopyDrafter`
keeps the alignment with the source across rounds, and `CopyFirst` puts it in front of a draft
model when a request brings a prediction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..llama import common_prefix
from .drafters import Draft, Drafter
from .modes import COPY
from .sampling import SamplingParams
from .sources import CopySource, NgramIndex, repeats, request_grams
from .spec import SpecParams

if TYPE_CHECKING:
    from .constraints import Constraint


# Prior acceptance of the next copied token by run length (tokens the current copy has matched):
# between what the next token did after such runs on Spec-Bench and on the edit suite (8-15
# tokens: 0.80 and 0.98; 16-31: 0.86 and 0.99; docs/benchmarks.md section 44,
# tools/copy_replay.py), so a real copy is drafted (and so measured) early and a chance repeat
# must earn its drafts. Runs below 8 are learned one by one: a chance match fails within a token
# or two of its anchor while a real copy passes every one of them, so a shared 4-7 bucket took
# four acceptances from each real copy against one rejection from each chance match and kept
# drafting long after chance anchors (section 49). Longer runs share a bucket per bit length
# (8-15, 16-31, ..., 128+), where acceptance is flat.
PRIOR = (0.2, 0.45, 0.45, 0.7, 0.7, 0.7, 0.7, 0.85, 0.92, 0.95, 0.97, 0.98)
# The prior weighs as two observed tokens per bucket. One would let the answer's first verified
# draft outweigh it (a held copy then ramps 3, 15, 31, 63 tokens rather than 3, 15, 15, 31), but
# three real copies would then outweigh two chance anchors failing at their first token, and the
# policy kept drafting 63 tokens at each (docs/benchmarks.md section 53).
PRIOR_WEIGHT = 2.0
# A memory entry this answer has kept no draft from yet must match this many tokens first, unless
# the request's own text holds the same match: answers to other requests share up to 12 tokens of
# boilerplate and then differ ("we need to follow these steps:\n\n1. Calculate the",
# docs/benchmarks.md sections 51 and 52). For a request that repeats the entry's request the
# match counts from the entry's lead, the end of that request's prompt (section 55).
MEMORY_RUN = 16
MATCH_LIMIT = 64  # an anchor's match is measured back this far at most: runs past it are as reliable
MEMORY = 48.0  # counts per bucket are scaled down past this: the policy follows the current text


def _matched(context: Sequence[int], source: Sequence[int], found: tuple[int, int]) -> int:
    """How many tokens the context's end matches before `source`'s position found[1], the n-gram
    index's found[0] tokens and further back (up to MATCH_LIMIT): an answer whose opening copies
    a memory entry matches it from the prompt's last tokens on (docs/benchmarks.md section 55)."""
    n, at = found
    stop = min(MATCH_LIMIT, at, len(context))
    while n < stop and context[len(context) - 1 - n] == source[at - 1 - n]:
        n += 1
    return n


def _bucket(run: int) -> int:
    """Runs 1..7 a bucket each (0..6), then 8-15, 16-31, ... by bit length (7, 8, ..., 11 for 128+)."""
    return run - 1 if run < 8 else min(run.bit_length() + 3, len(PRIOR) - 1)


class CopyPolicy:
    """How many tokens of a copy to draft: the length that maximises expected tokens per unit of
    target cost, or none when no length beats a plain decoding step.

    Each drafted token is accepted with a probability learned per run length (how long the copy
    has matched so far); a draft of k tokens commits 1 + sum_i prod_{j<=i} p(run + j) tokens for
    one verification of k + 1 tokens, which costs `batch_cost(k + 1)` single steps (the target's
    measured cost profile). A draft must beat a plain step by `margin`.

    With server slots the verification shares its decode with `others` tokens of the other
    generations, so what counts is the step's yield: (others + expected) / batch_cost(others +
    k + 1) against (others + 1) / batch_cost(others + 1). On AMX Q4_0 verifying a draft of 15
    alone costs 2.9 single steps (16 rows), while beside 7 other slots' next tokens a draft of 8
    fills the same 16 rows for 1.2x the step it joins (101.4 against 84.4 ms, docs/benchmarks.md
    section 19); sized as if alone, the slots' drafts made every shared step dearer (section 26).
    """

    def __init__(self, batch_cost: Callable[[int], float], margin: float = 0.05) -> None:
        self.batch_cost = batch_cost
        self.margin = margin
        self.reset()
        self._costs: dict[int, float] = {}

    def reset(self) -> None:
        """Back to the prior, for a new request: what one request's copies did says little about
        the next one's (an agent's type-hinting request broke its copies at every signature, the
        follow-up resending the file copied it whole, docs/benchmarks.md section 53)."""
        self.counts: list[list[float]] = [[PRIOR_WEIGHT * p, PRIOR_WEIGHT * (1 - p)] for p in PRIOR]

    def p_accept(self, run: int) -> float:
        a, r = self.counts[_bucket(max(run, 1))]
        return a / (a + r)

    def cost(self, n: int) -> float:
        c = self._costs.get(n)
        if c is None:
            c = self._costs[n] = max(float(self.batch_cost(n)), 1e-9) / max(float(self.batch_cost(1)), 1e-9)
        return c

    def length(self, run: int, k_max: int, others: int = 0) -> int:
        """The draft length for a copy that has matched `run` tokens (0: do not draft), in a decode
        that also carries `others` tokens of other sequences."""
        plain = (others + 1) / self.cost(others + 1)
        best_k, best = 0, plain * (1.0 + self.margin)
        expected, survive = 1.0, 1.0
        for k in range(1, k_max + 1):
            survive *= self.p_accept(run + k - 1)
            expected += survive
            gain = (others + expected) / self.cost(others + k + 1)
            if gain > best:
                best_k, best = k, gain
        return best_k

    def observe(self, run: int, drafted: int, accepted: int) -> None:
        """Learn from one verified draft: tokens before `accepted` were accepted, the next rejected."""
        for j in range(min(accepted + 1, drafted)):
            c = self.counts[_bucket(run + j)]
            c[0 if j < accepted else 1] += 1.0
            if c[0] + c[1] > MEMORY:
                c[0] *= MEMORY / (c[0] + c[1])
                c[1] = MEMORY - c[0]


class CopyDrafter:
    """Drafts what comes next in a copy of earlier text, for answers that rewrite text they were
    given: edits returned as whole files, refactors, quotes. The copy comes from the context (the
    prompt, earlier turns, its own output) or from the sources given to `begin` (a prediction,
    the copy memory).

    It keeps an n-gram index of the context, fed only the tokens appended since its last call
    (a context that does not extend the previous one is indexed anew), and an alignment with the
    copy's source: while the text keeps matching the source, the next draft continues where the
    last left off; after a mismatch it re-anchors on the longest earlier occurrence of the
    context's suffix in any source, the first given winning a tie (a prediction over the
    prompt that also holds the text). `CopyPolicy` picks the draft length, often 0, so a round
    without a reliable copy costs what plain decoding costs. Proposals are deterministic: q is
    a point mass and conf is 1.
    """

    def __init__(self, policy: CopyPolicy, others: Callable[[], int] | None = None) -> None:
        self.policy = policy
        self.others = others  # tokens the other slots put into the target's next decode, if shared
        self.index = NgramIndex()
        self.sources: list[CopySource] = []
        self.start: list[int] | None = None  # a prediction the answer has not met yet
        self.at: tuple[str, list[int]] | None = None  # the copy's source: (kind, its tokens)
        self.src: int | None = None  # the position in it the next token is expected to copy
        self.run = 0                 # tokens the current alignment has matched
        self.proven: set[int] = set()  # memory entries (id of their tokens) this answer kept a draft from
        self.repeated: set[int] = set()  # memory entries whose request this one repeats: their leads count
        self._last: tuple[int, list[int], int] | None = None  # (run, tokens, source id) of the draft awaiting `accept`

    def begin(self, prompt: Sequence[int], sources: Sequence[CopySource] = ()) -> None:
        """Keep the index when the prompt extends what it holds (a chat's next turn, a slot's next
        request on the same text), else index the prompt anew."""
        self._last = None
        self.policy.reset()
        self.sources = list(sources)
        self.proven = set()
        led = [s for s in self.sources if s.lead]
        mine = request_grams(prompt) if led else frozenset()
        self.repeated = {id(s.tokens) for s in led if repeats(mine, s.request)}
        if common_prefix(self.index.tokens, prompt) < len(self.index.tokens):
            self.index = NgramIndex()
        if self.at is None or self.at[1] is not self.index.tokens:  # a source of another request
            self.at, self.src, self.run = None, None, 0
        self._extend(prompt)
        # the answer is expected to start where the prediction does, or after a preamble ("```python")
        self.start = next((s.tokens for s in self.sources if s.kind == "prediction"), None)
        if self.start is not None:
            self.at, self.src, self.run = ("prediction", self.start), 0, 1

    def accept(self, n_accepted: int) -> None:
        if self._last is not None:
            run, drafted, source = self._last
            self.policy.observe(run, len(drafted), n_accepted)
            if n_accepted:
                self.proven.add(source)
            self._last = None

    def _extend(self, context: Sequence[int]) -> None:
        """Index what `context` adds to the tokens seen, following the copy's alignment."""
        toks = self.index.tokens
        if len(context) < len(toks) or (toks and context[len(toks) - 1] != toks[-1]):
            self.begin(context, self.sources)  # not an extension (a caller outside the loop): start over
            return
        for tok in context[len(toks):]:
            src = self.src
            if src is not None and src < len(self.at[1]) and self.at[1][src] == tok:
                self.src, self.run = src + 1, self.run + 1
                if src == 0 and self.at[1] is self.start:
                    self.start = None  # the answer starts with the prediction: no other start to look for
            else:
                self.at, self.src, self.run = None, None, 0
            self.index.append(tok)

    def _anchor(self, spec: SpecParams) -> None:
        """Align with the longest earlier occurrence of the context's end, if longer than the run;
        a source (prediction, memory) also takes over an equally long copy of the context."""
        toks = self.index.tokens
        keys = [tuple(toks[len(toks) - n:]) for n in range(min(spec.ngram_max, len(toks)), spec.ngram_min - 1, -1)]
        best, in_context = self.run, self.at is None or self.at[0] == "context"
        for source in self.sources:
            found = source.index.find(keys)
            if found is not None:
                n = _matched(toks, source.tokens, found)
                if source.lead and id(source.tokens) not in self.repeated:
                    n = min(n, found[1] - source.lead)  # the answer's part of the match only
                if n > 0 and (n > best or (n == best and in_context)):
                    best, self.at, self.src, in_context = n, (source.kind, source.tokens), found[1], False
        found = self.index.find(keys)  # the context's own end is not in its index: an earlier occurrence
        n = _matched(toks, toks, found) if found is not None else 0
        if n > best:
            best, self.at, self.src = n, ("context", toks), found[1]
        if self.start is not None:  # the context ends with the prediction's beginning: the answer meets it
            # a match there is cut by the prediction's start, not by a mismatch: it counts one more
            n = next((n for n in range(min(spec.ngram_max, len(self.start), len(toks)), 0, -1)
                      if toks[len(toks) - n:] == self.start[:n]), 0)
            # ... and where a longer copy found elsewhere goes on with the same text, it is the prediction's
            agrees = self.src is not None and self.at[1][self.src:self.src + 8] == self.start[n:n + 8]
            if n and (n + 1 >= best or agrees):
                best, self.at, self.src, self.start = max(n, best), ("prediction", self.start), n, None
        self.run = best

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator,
                spec: SpecParams, *, conf: bool = False, constraint: "Constraint | None" = None) -> Draft:
        draft = Draft(q=None if sp.greedy else [], origin=COPY)
        self._extend(context)
        # no copy yet, or a short one a longer match may beat; a prediction that still matches is kept
        if self.run < spec.ngram_max and (self.at is None or self.at[0] != "prediction"):
            self._anchor(spec)
        if self.src is None:
            return draft
        kind, toks = self.at
        if kind == "memory" and self.run < MEMORY_RUN and id(toks) not in self.proven:
            ctx, n = self.index.tokens, min(self.run, spec.ngram_max)
            if self.index.find([tuple(ctx[len(ctx) - n:])]) is None:
                return draft  # only another request's answer holds it: shared boilerplate is no copy yet
        k = self.policy.length(self.run, min(k, spec.copy_max, len(toks) - self.src),
                               self.others() if self.others is not None else 0)
        if constraint is not None:  # the copy up to where the grammar would refuse it
            k = constraint.allowed_prefix(context, toks[self.src:self.src + k])
        if k == 0:
            return draft
        draft.tokens = toks[self.src:self.src + k]
        draft.source = kind
        self._last = (self.run, draft.tokens, id(toks))
        if conf:
            draft.conf = [1.0] * k
        if draft.q is not None:
            draft.q = [None] * k  # point masses (see Decoder._verify)
        return draft


class CopyFirst:
    """A draft model with a copy drafter in front, for modes that draft with a model when the
    request brings a prediction: the copy where the policy finds one worth drafting, else the
    model's draft."""

    def __init__(self, copy: CopyDrafter, model: Drafter) -> None:
        self.copy, self.model = copy, model
        self._last: Drafter | None = None

    def begin(self, prompt: Sequence[int], sources: Sequence[CopySource] = ()) -> None:
        self.copy.begin(prompt, sources)
        self.model.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator,
                spec: SpecParams, *, conf: bool = False, constraint: "Constraint | None" = None) -> Draft:
        draft = self.copy.propose(context, k, sp, rng, spec, conf=conf, constraint=constraint)
        self._last = self.copy if draft.tokens else self.model
        return draft if draft.tokens else self.model.propose(context, k, sp, rng, spec, conf=conf,
                                                             constraint=constraint)

    def accept(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.accept(n_accepted)
            self._last = None
