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

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .constraints import Constraint
from .drafters import NGRAM_LIMIT, Draft, Drafter
from .errors import InvalidParameterError
from .llama import common_prefix
from .modes import DRAFT, SLIM, TARGET, Origin, Tier, mode_info
from .sampling import Dist, SamplingParams
from .scores import Rows, Scorer, TokenLogprobs
from .stats import Stats

ROUTES = ("slim", "draft", "both")
Committed = tuple[int, Origin, Tier]
Resync = Callable[[int, int], "int | None"]  # (output index, token) -> the token the context continues with


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
    copy_max: int = _knob(32, "lookup: longest copied draft; each round drafts 0..this, chosen from the "
                              "copy's record and the target's batch costs.")
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


class Decoder:
    """Holds the models of one engine and runs one generation at a time.

    Models are `Scorer`s: llama.cpp models in the engine, recorded traces in the tuner's replay.
    """

    def __init__(self, target: Scorer, drafter: Drafter | None = None, slim: Scorer | None = None,
                 spec: SpecParams = SpecParams(), constraint: Constraint | None = None,
                 top_logprobs: int | None = None) -> None:
        self.target, self.drafter, self.slim, self.spec = target, drafter, slim, spec
        self.constraint = constraint  # a grammar every chosen token obeys (constraints.py)
        # with `top_logprobs`, the target's log-probabilities of each committed token (and of its
        # `top_logprobs` likeliest), by position in the context, read from its verifying rows
        # (lossless modes only: see modes.check_logprobs)
        self.top_logprobs = top_logprobs
        self.logprobs: dict[int, TokenLogprobs] = {}

    def generate(self, prompt: Sequence[int], mode: str, sp: SamplingParams, max_new: int, stats: Stats,
                 resync: Resync | None = None) -> Iterator[Committed]:
        """Yield (token, origin, tier) until EOS, `max_new` tokens or a full context window.

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
        while produced < max_new and len(ctx) < self.target.n_ctx:
            budget = min(max_new - produced, self.target.n_ctx - len(ctx))
            stats.rounds += 1
            for tok, origin, tier in rounds(ctx, sp, rng, stats, budget):
                other = resync(produced, tok) if resync is not None else None
                ctx.append(tok if other is None else other)
                if self.constraint is not None:
                    self.constraint.commit(tok)
                produced += 1
                stats.count(origin, tier)
                yield tok, origin, tier
                if self.target.is_eog(tok) or produced >= max_new:
                    return
                if other is not None:
                    break

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
        stats.draft_n += len(draft)
        stats.draft_rounds += bool(draft.tokens)
        return draft

    def _record(self, rows: Rows, start: int, tokens: Sequence[int]) -> None:
        """Log-probabilities of `tokens`, committed at positions start.., from the target's rows."""
        if self.top_logprobs is not None:
            for i, tok in enumerate(tokens):
                self.logprobs[start + i] = rows.logprobs(i, tok, self.top_logprobs)

    @staticmethod
    def _verify(rows: Rows, tokens: Sequence[int], qs: Sequence[Dist | None] | None,
                sp: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
        """The sd rule: (how many of `tokens` are accepted, the verifier's next token).

        rows[i] is the verifier's prediction for the position of tokens[i]; rows[len] is the bonus
        row. Greedy: longest prefix equal to the argmax. Sampling: accept with min(1, p/q), else
        draw from the normalised residual max(0, p - q). A q of None is a point mass on the
        token (a copy): accept with probability p, else draw from p without the token.
        """
        for i, tok in enumerate(tokens):
            if sp.greedy:
                best = rows.argmax(i)
                if best != tok:
                    return i, best
                continue
            p = rows.dist(i, sp)
            q = qs[i]
            if rng.random() * (1.0 if q is None else q.prob(tok)) < p.prob(tok):
                continue
            return i, p.residual(q, tok).sample(rng)
        n = len(tokens)
        return n, rows.argmax(n) if sp.greedy else rows.dist(n, sp).sample(rng)

    # ---- modes ----------------------------------------------------------------------------------
    def _ar_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                  budget: int) -> list[Committed]:
        rows = self._eval(self.target, ctx, (), 1)
        tok = rows.argmax(0) if sp.greedy else rows.dist(0, sp).sample(rng)
        self._record(rows, len(ctx), [tok])
        return [(tok, TARGET, "C")]

    def _sd_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                  budget: int) -> list[Committed]:
        draft = self._draft(ctx, budget, sp, rng, stats)
        if not draft.tokens:
            return self._ar_round(ctx, sp, rng, stats, budget)
        return self._target_verifies(ctx, draft.tokens, draft.q, sp, rng)

    def _target_verifies(self, ctx: list[int], tokens: list[int], qs: Sequence[Dist | None] | None,
                         sp: SamplingParams, rng: np.random.Generator) -> list[Committed]:
        """One batched target call: catch up on unseen context, verify `tokens`, add its own token."""
        rows = self._eval(self.target, ctx, tokens, len(tokens) + 1)
        n, nxt = self._verify(rows, tokens, qs, sp, rng)
        self._record(rows, len(ctx), tokens[:n] + [nxt])
        return [(t, self.drafter.origin, "C") for t in tokens[:n]] + [(nxt, TARGET, "C")]

    def _via_round(self, ctx: list[int], sp: SamplingParams, rng: np.random.Generator, stats: Stats,
                   budget: int) -> list[Committed]:
        spec = self.spec
        # tiers A/B add no token of their own, so the draft may fill the budget, unless every
        # token goes to the target anyway (tau_full > 1), which must then behave exactly like sd
        draft = self._draft(ctx, budget, sp, rng, stats, reserve=int(spec.tau_full > 1),
                            conf=spec.route != "slim")
        if not draft.tokens:
            return self._ar_round(ctx, sp, rng, stats, budget)
        lag = len(ctx) - common_prefix(self.target.tokens, ctx)  # committed tokens the target has not seen
        needs_slim = spec.tau_accept > 0 and spec.tau_full <= 1 and not self._lag_exceeded(lag)
        # srows[i] is the slim's prediction for the position of draft token i
        srows = self._eval(self.slim, ctx, draft.tokens[:-1], len(draft)) if needs_slim else None
        out: list[Committed] = []
        for i, tok in enumerate(draft.tokens):
            tier = self._tier(srows, draft, i, lag + len(out))
            if tier != "C" and self.constraint is not None and \
                    not self.constraint.allows(ctx + [t for t, _, _ in out], tok):
                tier = "C"  # only the target may choose where the draft broke the grammar
            if tier == "B":
                regen = srows.argmax(i) if sp.greedy else srows.dist(i, sp).sample(rng)
                if regen != tok:
                    return out + [(regen, SLIM, "B")]
            if tier == "C":
                committed = ctx + [t for t, _, _ in out]
                qs = draft.q[i:] if draft.q is not None else None
                return out + self._target_verifies(committed, draft.tokens[i:], qs, sp, rng)
            out.append((tok, DRAFT, tier))
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
            if qs is not None:
                qs += draft.q[:keep]
            if keep < len(draft) or any(self.target.is_eog(t) for t in draft.tokens):
                break
        if not block:
            return self._ar_round(ctx, sp, rng, stats, budget)
        return self._target_verifies(ctx, block, qs, sp, rng)
