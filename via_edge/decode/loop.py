"""The decoding loop: plain (`ar`), speculative (`sd`), VIA-SD three-tier (`via`) and lossless
hierarchical (`hier`), as one generator that yields each committed token with its origin.

One round of `via` (after Xian et al., 2026, on llama.cpp):

    draft  d_1..d_k                          drafter proposes
    slim   q'(. | x, d_<i) for all i          one batched slim call (catches up on new context too)
    for each d_i in order, r_i = q'(d_i) / max q'
        r_i >= tau_accept            -> keep d_i                          (tier A)
        tau_full <= r_i < tau_accept -> slim regenerates; stop if it differs (tier B)
        r_i < tau_full               -> target verifies d_i.. with the sd rule (tier C)

The target is only called in tier C (or when its lag behind the committed text reaches
`max_lag`), and then catches up on everything committed since its last call in the same batch.
`sd` and `hier` are lossless: greedy output equals the target's greedy output, and sampled output
follows the target's distribution exactly (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..llama import common_prefix
from .constraints import Constraint
from .drafters import Draft, Drafter
from .modes import COPY, DRAFT, SLIM, TARGET, Origin, Tier, mode_info
from .sampling import Dist, SamplingParams
from .scores import Rows, Scorer, TokenLogprobs
from .sources import CopySource
from .spec import SpecParams
from .stats import Stats


class Committed(NamedTuple):
    """One token as the loop commits it: who produced it, what decided it, and (when asked for)
    the target's log-probability of it and of its likeliest alternatives."""

    token: int
    origin: Origin
    tier: Tier
    logprob: TokenLogprobs | None = None


Resync = Callable[[int, int], "int | None"]  # (output index, token) -> the token the context continues with


class Decoder:
    """One generation: the models it reads, its knobs, its grammar and logit rules.

    Models are `Scorer`s: llama.cpp models in the engine, recorded traces in the tuner's replay.
    """

    def __init__(self, target: Scorer, drafter: Drafter | None = None, slim: Scorer | None = None,
                 spec: SpecParams = SpecParams(), constraint: Constraint | None = None,
                 top_logprobs: int | None = None, sources: Sequence[CopySource] = ()) -> None:
        self.target, self.drafter, self.slim, self.spec = target, drafter, slim, spec
        self.sources = sources  # copy sources beside the context: a prediction, the copy memory
        self.constraint = constraint  # a grammar every chosen token obeys (constraints.py)
        # with `top_logprobs`, each committed token carries the target's log-probability of it and
        # of its `top_logprobs` likeliest, read from the verifying rows (lossless modes only: see
        # modes.check_logprobs)
        self.top_logprobs = top_logprobs
        self._proposed: list[int] | None = None  # the tokens put up for verification this round
        self._source = ""  # what the round's first draft copied from, if a copy

    def generate(self, prompt: Sequence[int], mode: str, sp: SamplingParams, max_new: int, stats: Stats,
                 resync: Resync | None = None) -> Iterator[Committed]:
        """Yield each `Committed` token until EOS, `max_new` tokens or a full context window.

        The caller may stop early (stop strings); KV caches stay consistent either way because
        every model re-syncs to the committed context at its next call. `resync` (the replay's)
        may put another token into the context in place of a committed one, ending the round.
        """
        info = mode_info(mode)
        if info.drafter and self.drafter is None:
            raise InvalidParameterError(f"mode {mode} needs a drafter")
        if info.slim and self.slim is None:
            raise InvalidParameterError(f"mode {mode} needs a slim verifier")
        rounds = {"ar": self._ar_round, "sd": self._sd_round, "via": self._via_round,
                  "hier": self._hier_round}[info.rounds]
        rng = sp.rng()
        ctx = list(prompt)
        produced = 0
        if self.constraint is not None:
            self.constraint.start(len(ctx))
        if self.drafter is not None:
            self.drafter.begin(ctx, self.sources)
        while produced < max_new and len(ctx) < self.target.n_ctx:
            budget = min(max_new - produced, self.target.n_ctx - len(ctx))
            stats.rounds += 1
            self._proposed, self._source = None, ""
            start = len(ctx)
            try:
                for c in rounds(ctx, sp, rng, stats, budget):
                    other = resync(produced, c.token) if resync is not None else None
                    ctx.append(c.token if other is None else other)
                    if self.constraint is not None:
                        self.constraint.commit(c.token)
                    produced += 1
                    stats.count(c.origin, c.tier)
                    yield c
                    if self.target.is_eog(c.token) or produced >= max_new:
                        return
                    if other is not None:
                        break
            finally:  # the round's last token may end the generation, or the caller stop it
                if self._proposed is not None:  # how much of its draft the context kept
                    kept = common_prefix(self._proposed, ctx[start:])
                    self.drafter.accept(kept)
                    stats.copied_from(self._source, 0, kept)

    # ---- shared pieces --------------------------------------------------------------------------
    def _eval(self, model: Scorer, ctx: list[int], tokens: Sequence[int], n_rows: int) -> Rows:
        """`model`'s last n_rows rows for ctx + tokens, row 0 following ctx: what the grammar
        allows at each row when there is one."""
        rows = model.eval(ctx + list(tokens), n_rows)
        return rows if self.constraint is None else self.constraint.rows(rows, ctx, tokens)

    def _draft(self, ctx: list[int], budget: int, sp: SamplingParams, rng: np.random.Generator,
               stats: Stats, k: int | None = None, reserve: int = 1, conf: bool = False) -> Draft:
        """Up to k tokens (default: as many as the drafter's own knob allows), leaving `reserve`
        places for the verifier's own token (budget, context)."""
        room = min(budget, self.target.n_ctx - len(ctx)) - reserve
        k = room if k is None else min(k, room)
        if k <= 0:
            return Draft()
        draft = self.drafter.propose(ctx, k, sp, rng, self.spec, conf=conf, constraint=self.constraint)
        if draft.tokens:
            self._proposed = draft.tokens
            self._source = self._source or draft.source
            stats.copied_from(draft.source, len(draft), 0)
        stats.draft_n += len(draft)
        stats.draft_rounds += bool(draft.tokens)
        return draft

    def _logprob(self, rows: Rows, i: int, token: int) -> TokenLogprobs | None:
        """The target's log-probabilities at row i for `token`, when asked for."""
        return None if self.top_logprobs is None else rows.logprobs(i, token, self.top_logprobs)

    @staticmethod
    def _verify(rows: Rows, tokens: Sequence[int], qs: Sequence[Dist | None] | None,
                sp: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
        """The sd rule: (how many of `tokens` are accepted, the verifier's next token).

        rows[i] is the verifier's prediction for the position of tokens[i]; rows[len] is the bonus
        row. Greedy: longest prefix equal to the argmax. Sampling: accept with min(1, p/q), else
        draw from the normalised residual max(0, p - q). A q of None is a point mass on the
        token (a copy): draw from p as `ar` would and keep the token if the draw is it (kept
        with probability p, else a draw from p without it, as the rule asks), so each committed
        token takes one draw and a seeded answer is `ar`'s whatever was copied or cached.
        """
        for i, tok in enumerate(tokens):
            if sp.greedy:
                best = rows.argmax(i)
                if best != tok:
                    return i, best
                continue
            p = rows.dist(i, sp)
            q = qs[i]
            if q is None:
                drawn = p.sample(rng)
                if drawn == tok:
                    continue
                return i, drawn
            if rng.random() * q.prob(tok) < p.prob(tok):
                continue
            return i, p.residual(q).sample(rng)
        n = len(tokens)
        return n, rows.argmax(n) if sp.greedy else rows.dist(n, sp).sample(rng)

    # ---- modes ----------------------------------------------------------------------------------
    def _ar_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                  budget: int) -> list[Committed]:
        rows = self._eval(self.target, ctx, (), 1)
        tok = rows.argmax(0) if sp.greedy else rows.dist(0, sp).sample(rng)
        return [Committed(tok, TARGET, "C", self._logprob(rows, 0, tok))]

    def _sd_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                  budget: int) -> list[Committed]:
        draft = self._draft(ctx, budget, sp, rng, stats)
        if not draft.tokens:
            return self._ar_round(ctx, sp, rng, stats, budget)
        return self._target_verifies(ctx, draft.tokens, draft.q, sp, rng, draft.origin)

    def _target_verifies(self, ctx: list[int], tokens: list[int], qs: Sequence[Dist | None] | None,
                         sp: SamplingParams, rng: np.random.Generator, origin: Origin) -> list[Committed]:
        """One batched target call: catch up on unseen context, verify `tokens`, add its own token."""
        rows = self._eval(self.target, ctx, tokens, len(tokens) + 1)
        n, nxt = self._verify(rows, tokens, qs, sp, rng)
        return [Committed(t, origin, "C", self._logprob(rows, i, t)) for i, t in enumerate(tokens[:n])] + \
            [Committed(nxt, TARGET, "C", self._logprob(rows, n, nxt))]

    def _via_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                   budget: int) -> list[Committed]:
        spec = self.spec
        # tiers A/B add no token of their own, so the draft may fill the budget, unless every
        # token goes to the target anyway (tau_full > 1), which must then behave exactly like sd
        draft = self._draft(ctx, budget, sp, rng, stats, reserve=int(spec.tau_full > 1),
                            conf=spec.route != "slim")
        if not draft.tokens:
            return self._ar_round(ctx, sp, rng, stats, budget)
        if draft.origin == COPY:  # a copy (of a prediction) adds no loss of its own: the target verifies it
            return self._target_verifies(ctx, draft.tokens, draft.q, sp, rng, COPY)
        lag = len(ctx) - common_prefix(self.target.tokens, ctx)  # committed tokens the target has not seen
        needs_slim = spec.tau_accept > 0 and spec.tau_full <= 1 and not self._lag_exceeded(lag)
        # srows[i] is the slim's prediction for the position of draft token i
        srows = self._eval(self.slim, ctx, draft.tokens[:-1], len(draft)) if needs_slim else None
        out: list[Committed] = []
        for i, tok in enumerate(draft.tokens):
            tier = self._tier(srows, draft, i, lag + len(out))
            if tier != "C" and self.constraint is not None and \
                    not self.constraint.allows(ctx + [c.token for c in out], tok):
                tier = "C"  # only the target may choose where the draft broke the grammar
            if tier == "B":
                regen = srows.argmax(i) if sp.greedy else srows.dist(i, sp).sample(rng)
                if regen != tok:
                    return out + [Committed(regen, SLIM, "B")]
            if tier == "C":
                committed = ctx + [c.token for c in out]
                qs = draft.q[i:] if draft.q is not None else None
                return out + self._target_verifies(committed, draft.tokens[i:], qs, sp, rng, DRAFT)
            out.append(Committed(tok, DRAFT, tier))
            if self.target.is_eog(tok):
                break
        return out

    def _lag_exceeded(self, lag: int) -> bool:
        return bool(self.spec.max_lag) and lag >= self.spec.max_lag

    def _tier(self, srows: Rows | None, draft: Draft, i: int, lag: int) -> Tier:
        spec = self.spec
        if self._lag_exceeded(lag) or spec.tau_full > 1:
            return "C"
        if spec.tau_accept <= 0:
            return "A"
        r = self._score(srows, draft, i)
        return "A" if r >= spec.tau_accept else "B" if r >= spec.tau_full else "C"

    def _score(self, srows: Rows, draft: Draft, i: int) -> float:
        """The routing score r of draft token i: from the slim, the draft's own probability, or both."""
        if self.spec.route == "draft":
            return draft.conf[i]
        slim_r = srows.ratio(i, draft.tokens[i])
        return slim_r if self.spec.route == "slim" else min(slim_r, draft.conf[i])

    def _hier_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                    budget: int) -> list[Committed]:
        """The slim filters and extends drafts; the target verifies the longer block once.

        Draft chunks are scored by the slim as in `via`; the block is cut before the first token
        scoring below tau_full (the target would likely reject it), and while every token passes,
        the drafter extends the block up to `hier_block` tokens. Only draft tokens enter the block,
        so the sd rule with the draft's distributions keeps the output exactly the target's.
        """
        limit = min(self.spec.hier_block, budget - 1, self.target.n_ctx - len(ctx) - 1)
        block: list[int] = []
        qs: list[Dist | None] | None = None if sp.greedy else []
        origin: Origin = COPY  # a block of copies only, else the draft model's
        while len(block) < limit:
            base = ctx + block
            draft = self._draft(base, budget, sp, rng, stats, k=min(self.spec.n_draft, limit - len(block)))
            if not draft.tokens:
                break
            srows = self._eval(self.slim, base, draft.tokens[:-1], len(draft))
            keep = 0
            while keep < len(draft) and srows.ratio(keep, draft.tokens[keep]) >= self.spec.tau_full:
                keep += 1
            block += draft.tokens[:keep]
            origin = origin if draft.origin == COPY else DRAFT
            if qs is not None:
                qs += draft.q[:keep]
            if keep < len(draft) or any(self.target.is_eog(t) for t in draft.tokens):
                break
        if not block:
            return self._ar_round(ctx, sp, rng, stats, budget)
        self._proposed = block  # the drafts it chained, as verified
        return self._target_verifies(ctx, block, qs, sp, rng, origin)
