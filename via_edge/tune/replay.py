"""Offline replay: run the decoding loop of `decoding.Decoder` on recorded traces instead of models,
pricing every model call with the cost profile, to predict speed and fidelity of a configuration.

Each round below mirrors its counterpart in `Decoder` (greedy only) and so do the KV caches:
each model's cache is tracked as the tokens it holds, and a call costs one decode of what the
real `LlamaModel.eval` would decode (the batch past the common prefix) at that context length.

What is exact and what is not:
- `ar`, `sd`, `lookup` and `hier` commit exactly the tokens, origins and tiers of a real greedy
  run whose kernels compute batches as single decodes do (the records are teacher-forced along
  the target's own output, and a draft token is accepted exactly when it equals it).
- Draft tokens proposed after a draft token the target will reject are not recorded; they never
  change what is committed, only costs: they are taken as not EOS, with the draft's confidence
  and the slim's score at the same position of the trace as stand-ins (p_min, hier's filter).
- `via` is exact up to its first token that differs from the target's. There the replay counts
  an error and resynchronises on the target's token (the records know nothing else), ending the
  round. Fidelity is predicted from the resulting per-token error rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..decoding import SpecParams
from ..drafters import PromptLookupDrafter
from ..sampling import SamplingParams
from .record import SlimTrace, Trace

Cost = Callable[[str, int, int], float]  # (model, batch tokens, context length) -> seconds
GREEDY = SamplingParams()


@dataclass
class Replayed:
    """What one replayed generation committed and what it cost."""

    tokens: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    errors: int = 0           # committed tokens that differ from the target's greedy token there
    first_error: int = -1     # position of the first one (-1: none)
    rounds: int = 0
    draft_n: int = 0
    seconds: float = 0.0
    calls: dict = field(default_factory=lambda: {"draft": 0, "slim": 0, "target": 0})


class _Seq:
    """A token sequence as the trace sees it: `a` tokens equal to the trace, then `junk`."""

    __slots__ = ("a", "junk")

    def __init__(self, a: int, junk: tuple = ()) -> None:
        self.a, self.junk = a, junk

    def __len__(self) -> int:
        return self.a + len(self.junk)

    def common(self, other: "_Seq") -> int:
        if self.a != other.a:  # one side is on the trace where the other is not
            return min(self.a, other.a)
        n = 0
        for x, y in zip(self.junk, other.junk):
            if x != y:
                break
            n += 1
        return self.a + n


class Replay:
    """Replays one trace under one configuration (construct, then `run()`)."""

    def __init__(self, trace: Trace, slim: SlimTrace | None, mode: str, spec: SpecParams, cost: Cost,
                 eog: Sequence[int], slim_model: str = "slim", n_ctx: int = 4096,
                 lookup: PromptLookupDrafter | None = None) -> None:
        self.mode, self.spec, self.cost, self.eog = mode, spec, cost, set(eog)
        self.p0 = len(trace.prompt)
        self.seq = trace.prompt + [int(t) for t in trace.target]  # the trace as one token list
        self.T = [int(t) for t in trace.target]
        self.D = [int(t) for t in trace.draft]
        self.DP = [float(p) for p in trace.draft_p]
        self.S = [int(t) for t in slim.top] if slim is not None else None
        self.R = [float(r) for r in slim.ratio] if slim is not None else None
        self.names = {"draft": "draft", "slim": slim_model, "target": "target"}
        self.n_ctx, self.lookup = n_ctx, lookup
        self.out = Replayed()
        self._junk = 0

    # ---- model calls, priced -----------------------------------------------------------------
    def _seq(self, j: int, chain: Sequence[int]) -> _Seq:
        """ctx (the trace's prompt and first j tokens) + chain."""
        a = self.p0 + j
        i = 0
        while i < len(chain) and a < len(self.seq) and chain[i] == self.seq[a]:
            a, i = a + 1, i + 1
        return _Seq(a, tuple(chain[i:]))

    def _eval(self, role: str, seq: _Seq, n_rows: int) -> None:
        """As LlamaModel.eval: keep the common prefix (but recompute the asked rows), decode the rest."""
        n = len(seq)
        keep = min(self.cache[role].common(seq), n - n_rows)
        self._decode(role, n - keep, keep)
        self.cache[role] = seq

    def _decode(self, role: str, n: int, ctx: int) -> None:
        self.out.seconds += self.cost(self.names[role], n, ctx)
        self.out.calls[role] += 1

    def _placeholder(self) -> int:
        self._junk -= 1
        return self._junk

    # ---- drafting (ModelDrafter / PromptLookupDrafter, greedy) ------------------------------
    def _draft(self, base: _Seq, j: int, budget: int, k: int | None = None, reserve: int = 1) -> list[int]:
        """Tokens the drafter proposes after `base`, whose first token sits at trace position j."""
        spec = self.spec
        k = min(spec.n_draft if k is None else k, budget - reserve, self.n_ctx - len(base) - reserve)
        if k <= 0:
            return []
        if self.lookup is not None:
            ctx = self.seq[:base.a] + list(base.junk)
            chain = self.lookup.propose(ctx, k, GREEDY, None).tokens
            self.out.draft_n += len(chain)
            return chain
        chain: list[int] = []
        on_trace = not base.junk
        self._eval("draft", base, 1)
        for i in range(k):
            pos = j + i
            p_best = self.DP[pos] if pos < len(self.DP) else 0.0
            if i >= spec.n_min and p_best < spec.p_min:
                break
            tok = self.D[pos] if on_trace else self._placeholder()
            on_trace = on_trace and tok == self.T[pos]
            chain.append(tok)
            if i + 1 == k or tok in self.eog:
                break
            cached = self.cache["draft"]
            self._decode("draft", 1, len(cached))
            self.cache["draft"] = self._extend(cached, tok)
        self.out.draft_n += len(chain)
        return chain

    def _extend(self, seq: _Seq, tok: int) -> _Seq:
        if not seq.junk and seq.a < len(self.seq) and self.seq[seq.a] == tok:
            return _Seq(seq.a + 1)
        return _Seq(seq.a, seq.junk + (tok,))

    # ---- committing ----------------------------------------------------------------------------
    def _commit(self, tok: int, origin: str, tier: str) -> bool:
        """Record one token; True when it ended on an error (the round must stop and resync)."""
        pos = len(self.out.tokens)
        o = self.out
        o.tokens.append(tok)
        o.origins.append(origin)
        o.tiers.append(tier)
        if tok != self.T[pos]:
            o.errors += 1
            if o.first_error < 0:
                o.first_error = pos
            return True
        return False

    def _target_verifies(self, j: int, tokens: list[int]) -> list[tuple[int, str, str]]:
        self._eval("target", self._seq(j, tokens), len(tokens) + 1)
        n = 0
        while n < len(tokens) and tokens[n] == self.T[j + n]:
            n += 1
        # past the trace's end the bonus token is never committed (the budget is spent)
        bonus = self.T[j + n] if j + n < len(self.T) else self._placeholder()
        return [(t, "draft", "C") for t in tokens[:n]] + [(bonus, "target", "C")]

    # ---- rounds --------------------------------------------------------------------------------
    def _ar_round(self, j: int, budget: int) -> list[tuple[int, str, str]]:
        self._eval("target", self._seq(j, ()), 1)
        return [(self.T[j], "target", "C")]

    def _sd_round(self, j, budget):
        chain = self._draft(self._seq(j, ()), j, budget)
        if not chain:
            return self._ar_round(j, budget)
        return self._target_verifies(j, chain)

    def _via_round(self, j, budget):
        spec = self.spec
        chain = self._draft(self._seq(j, ()), j, budget, reserve=int(spec.tau_full > 1))
        if not chain:
            return self._ar_round(j, budget)
        ctx = self._seq(j, ())
        lag = len(ctx) - self.cache["target"].common(ctx)
        needs_slim = spec.tau_accept > 0 and spec.tau_full <= 1 and not self._lag_exceeded(lag)
        if needs_slim:
            self._eval("slim", self._seq(j, chain[:-1]), len(chain))
        out: list[tuple[int, str, str]] = []
        for i, tok in enumerate(chain):
            pos = j + i
            tier = self._tier(pos, lag + len(out))
            if tier == "B":
                regen = self.S[pos]
                if regen != tok:
                    return out + [(regen, "slim", "B")]
            if tier in ("A", "B"):
                out.append((tok, "draft", tier))
                if tok != self.T[pos]:  # diverged: the records end here; resynchronise
                    return out
            else:
                return out + self._target_verifies(pos, chain[i:])
            if tok in self.eog:
                break
        return out

    def _lag_exceeded(self, lag: int) -> bool:
        return bool(self.spec.max_lag) and lag >= self.spec.max_lag

    def _tier(self, pos: int, lag: int) -> str:
        spec = self.spec
        if self._lag_exceeded(lag) or spec.tau_full > 1:
            return "C"
        if spec.tau_accept <= 0:
            return "A"
        r = self.R[pos] if spec.route == "slim" else self.DP[pos] if spec.route == "draft" \
            else min(self.R[pos], self.DP[pos])
        return "A" if r >= spec.tau_accept else "B" if r >= spec.tau_full else "C"

    def _hier_round(self, j, budget):
        spec = self.spec
        limit = min(spec.hier_block, budget - 1, self.n_ctx - (self.p0 + j) - 1)
        block: list[int] = []
        while len(block) < limit:
            base = self._seq(j, block)
            chain = self._draft(base, j + len(block), budget, k=min(spec.n_draft, limit - len(block)))
            if not chain:
                break
            self._eval("slim", self._seq(j, block + chain[:-1]), len(chain))
            keep = 0
            while keep < len(chain) and self.R[min(j + len(block) + keep, len(self.R) - 1)] >= spec.tau_full:
                keep += 1
            block += chain[:keep]
            if keep < len(chain) or any(t in self.eog for t in chain):
                break
        if not block:
            return self._ar_round(j, budget)
        return self._target_verifies(j, block)

    # ---- the loop (Decoder.generate) -----------------------------------------------------------
    def run(self) -> Replayed:
        mode = "sd" if self.mode == "lookup" else self.mode
        rounds = {"ar": self._ar_round, "sd": self._sd_round, "via": self._via_round,
                  "hier": self._hier_round}[mode]
        start = _Seq(self.p0 - 1)  # Engine._prefill leaves every model holding prompt[:-1]
        self.cache = {"draft": start, "slim": start, "target": start}
        max_new = len(self.T)
        while len(self.out.tokens) < max_new and self.p0 + len(self.out.tokens) < self.n_ctx:
            j = len(self.out.tokens)
            budget = min(max_new - j, self.n_ctx - self.p0 - j)
            self.out.rounds += 1
            for tok, origin, tier in rounds(j, budget):
                diverged = self._commit(tok, origin, tier)
                if tok in self.eog or len(self.out.tokens) >= max_new:
                    return self.out
                if diverged:
                    break
        return self.out


def predicted_agreement(error_rate: float, length: int) -> float:
    """Expected share of a `length`-token output before its first error, errors arriving at a
    constant per-token rate: the position-wise agreement a lossy mode keeps with the target
    (after a first difference, outputs rarely line up again)."""
    if error_rate <= 0:
        return 1.0
    q = 1.0 - error_rate
    return q * (1.0 - q ** length) / (error_rate * length)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
