"""Drafters: propose up to k tokens after a context, with the probabilities they were drawn from.

One small interface, llama.cpp's `common/speculative.cpp` shape: `begin(prompt)` once per generation,
`propose(context, k, sp, rng, spec)` each round (reading the knobs of `spec` that concern it), then
`accept(n)`: how many of the proposed tokens the committed context kept. `Draft.conf[i]` is the
drafter's own (untempered) probability of token i, the `draft` routing score; `Draft.q[i]` is the
distribution token i was sampled from, kept only when sampling because the lossless acceptance
rule needs it (None: a point mass on the token, as a copy is). `Draft.origin` says who the draft
tokens came from (a draft model, or a copy) and `Draft.source` what a copy copies: the context,
the request's prediction (OpenAI's Predicted Outputs) or the engine's copy memory. `begin` takes
those extra copy sources; only copy drafting reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from ..errors import IncompatibleModelsError
from ..llama import LlamaModel, common_prefix
from .modes import COPY, DRAFT, Origin
from .sampling import Dist, SamplingParams
from .scores import Scorer
from .spec import NGRAM_LIMIT, SpecParams

if TYPE_CHECKING:
    from .constraints import Constraint


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




class NgramIndex:
    """Every n-gram (n = 1..NGRAM_LIMIT) of a token list, mapped to the position right after its
    latest occurrence whose continuation is known. Updated per appended token (no rescans): the
    n-grams ending at the previous token are entered when the next one arrives, so the context's
    own suffix is never its own match.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_LIMIT + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks, i = self.tokens, len(self.tokens)
        for n in range(1, min(NGRAM_LIMIT, i) + 1):
            self._after[n][tuple(toks[i - n:i])] = i
        toks.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def longest_match(self, n_max: int, n_min: int = 1) -> tuple[int, int] | None:
        """(n, position after the latest earlier occurrence of the last n tokens) for the largest
        n in n_min..n_max that occurs earlier, or None."""
        toks = self.tokens
        return self.find([tuple(toks[len(toks) - n:]) for n in range(min(n_max, NGRAM_LIMIT, len(toks) - 1), n_min - 1, -1)])

    def find(self, keys: Sequence[tuple[int, ...]]) -> tuple[int, int] | None:
        """(n, position after the latest occurrence) of the first of `keys` (n-grams, longest
        first) that occurs here with a known continuation, or None."""
        for key in keys:
            at = self._after[len(key)].get(key)
            if at is not None:
                return len(key), at
        return None

    def snapshot(self) -> list[dict[tuple[int, ...], int]]:
        """The tables, for comparing an incrementally built index with one built from scratch."""
        return [dict(d) for d in self._after]


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
# docs/benchmarks.md sections 51 and 52).
MEMORY_RUN = 16
REQUEST_N = 8        # requests are compared by their distinct 8-grams ...
REQUEST_SHARED = 48  # ... and one repeats another only if it shares at least this many (see `repeats`)
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


def request_grams(prompt: Sequence[int]) -> frozenset[int]:
    """The prompt's distinct REQUEST_N-grams (hashed): what `repeats` compares two requests by."""
    return frozenset(hash(tuple(prompt[i:i + REQUEST_N])) for i in range(len(prompt) - REQUEST_N + 1))


def repeats(prompt: frozenset, earlier: frozenset) -> bool:
    """Whether a request mostly repeats an earlier one (an agent asking for the same file again
    with a change): half its n-grams and at least REQUEST_SHARED of them are the earlier's. The
    chat template and a system prompt share about 20 (Spec-Bench's short questions share up to
    58% with other prompts); two edit requests with the same instruction, 2-8%; an agent's
    follow-ups, 76-100% (docs/benchmarks.md section 55)."""
    shared = len(prompt & earlier)
    return shared >= REQUEST_SHARED and 2 * shared >= len(prompt)


class CopySource:
    """Tokens a copy may come from beside the context: a request's prediction (OpenAI's Predicted
    Outputs) or an entry of the engine's copy memory. Indexed once, on first use, then read only,
    so one source serves every slot at once.

    A memory entry starts with the last `lead` tokens of the prompt it answered, and keeps that
    prompt's `request_grams`: a match reaching back into the lead counts only for a request that
    `repeats` it (others share the instruction's last words, not the answer)."""

    def __init__(self, kind: str, tokens: Sequence[int], lead: int = 0,
                 request: frozenset[int] = frozenset()) -> None:
        self.kind = kind
        self.tokens = list(tokens)
        self.lead, self.request = lead, request
        self._index: NgramIndex | None = None

    @property
    def index(self) -> NgramIndex:
        if self._index is None:
            self._index = NgramIndex(self.tokens)
        return self._index


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
