"""Offline replay: the real decoding loop (`decode.loop.Decoder`) driven by recorded traces instead of
models, every model call priced with the cost profile, to predict speed and fidelity.

Each model of the pair is a `TraceModel`: it answers the loop's questions (argmax, routing ratio,
top probability) from the records and, like `LlamaModel.eval`, keeps the tokens its KV cache
would hold, so a call costs one decode of what the real model would decode at that context
length. No decoding rule lives here: the loop, the drafters and the KV prefix rule are the
engine's own.

What is exact and what is not (greedy only: the records hold argmaxes, not distributions):
- `ar`, `sd`, `lookup` and `hier` commit exactly the tokens, origins and tiers of a real greedy
  run whose kernels compute batches as single decodes do (the records are teacher-forced along
  the target's own output, and a draft token is accepted exactly when it equals it).
- Off the trace (after a draft token the target will reject) nothing was recorded. Such tokens
  never change what is committed, only costs: a model's argmax there is a fresh placeholder
  token that matches nothing, and its scores are those at the same position of the trace.
- `via` is exact up to its first token that differs from the target's. There the replay counts
  an error and resynchronises the context on the target's token (the records know nothing
  else), ending the round. Fidelity is predicted from the resulting per-token error rate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..decode.costs import Cost, verify_cost
from ..decode.copying import CopyDrafter, CopyPolicy
from ..decode.drafters import ModelDrafter
from ..decode.loop import Decoder
from ..decode.modes import Origin, Tier, mode_info
from ..decode.sampling import SamplingParams
from ..decode.spec import SpecParams
from ..decode.stats import Stats
from ..llama import common_prefix, reuse_point
from .record import SlimTrace, Trace

GREEDY = SamplingParams()


@dataclass
class Meter:
    """Prices every decode with the cost profile and counts calls per role."""

    cost: Cost
    seconds: float = 0.0
    calls: dict[str, int] = field(default_factory=lambda: {"draft": 0, "slim": 0, "target": 0})
    tokens: dict[str, int] = field(default_factory=lambda: {"draft": 0, "slim": 0, "target": 0})
    guesses: int = 0  # scores read off the trace, answered with stand-ins (see the module docstring)

    def charge(self, role: str, name: str, n: int, ctx: int) -> None:
        self.seconds += self.cost(name, n, ctx)
        self.calls[role] += 1
        self.tokens[role] += n


class TraceRows:
    """The rows of one eval of a `TraceModel`: row i predicts trace position `first + i`."""

    __slots__ = ("model", "first", "on", "n", "_fresh")

    def __init__(self, model: "TraceModel", first: int, on: int, n: int) -> None:
        self.model, self.first, self.on, self.n = model, first, on, n  # on: positions [0, on) on the trace
        self._fresh: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    def _recorded(self, i: int) -> bool:
        pos = self.first + i
        return pos < self.on and pos < len(self.model.top)

    def _at(self, i: int) -> int:
        return min(self.first + i, len(self.model.top) - 1)

    def argmax(self, i: int) -> int:
        if self._recorded(i):
            return int(self.model.top[self.first + i])
        if i not in self._fresh:
            self._fresh[i] = next(self.model.placeholders)
        return self._fresh[i]

    def _score(self, i: int) -> float:
        if not self._recorded(i):
            self.model.meter.guesses += 1
        return float(self.model.score[self._at(i)])

    def ratio(self, i: int, token: int) -> float:
        return self._score(i)

    def top_prob(self, i: int) -> float:
        return self._score(i)

    def dist(self, i: int, sp: SamplingParams) -> np.ndarray:
        raise NotImplementedError("traces record greedy decisions only")


class MeteredKV:
    """What a replayed model's KV cache holds and what each call costs: `LlamaModel.eval`'s
    prefix rule, priced by the meter. Subclasses answer the calls (`_rows`)."""

    def __init__(self, role: str, name: str, meter: Meter, tokens: Sequence[int], held: bool = False) -> None:
        self.role, self.name, self.meter = role, name, meter
        self.tokens: list[int] = list(tokens)
        self.held = held  # the last position's row is already computed (Seq.prime)

    def eval(self, tokens: Sequence[int], n_rows: int = 1):
        held, self.held = self.held, False
        extra = len(tokens) - len(self.tokens)
        if held and n_rows == extra + 1 and common_prefix(self.tokens, tokens) == len(self.tokens):
            if extra:  # only what follows the held row is decoded
                self.meter.charge(self.role, self.name, extra, len(self.tokens))
            self.tokens = list(tokens)
            return self._rows(tokens, n_rows)
        keep = reuse_point(self.tokens, tokens, n_rows)
        self.meter.charge(self.role, self.name, len(tokens) - keep, keep)
        self.tokens = list(tokens)
        return self._rows(tokens, n_rows)

    def decode(self, tokens: Sequence[int]):
        self.held = False
        self.meter.charge(self.role, self.name, len(tokens), len(self.tokens))
        self.tokens += tokens
        return self._rows(self.tokens, 1)

    def _rows(self, tokens: Sequence[int], n_rows: int):
        raise NotImplementedError


class TraceModel(MeteredKV):
    """One model of the pair along one trace: what it predicts at each position of the target's
    greedy output (`top`), its score there (`score`: the draft's top probability, or the slim's
    ratio for the draft's token), and what it costs."""

    def __init__(self, role: str, name: str, seq: list[int], p0: int, top: Sequence[int], score: Sequence[float],
                 meter: Meter, eog: frozenset[int], n_ctx: int, placeholders: Iterator) -> None:
        # the engine's prefill leaves the target holding the prompt and its last row (Seq.prime), the
        # other models holding prompt[:-1]
        target = role == "target"
        super().__init__(role, name, meter, seq[:p0] if target else seq[:p0 - 1], held=target)
        self.seq, self.p0 = seq, p0
        self.top, self.score = top, score
        self.eog, self.n_ctx, self.placeholders = eog, n_ctx, placeholders

    def _rows(self, tokens: Sequence[int], n_rows: int) -> TraceRows:
        # row i follows tokens[:len - n_rows + i + 1]; it is on the trace while that prefix is
        on = common_prefix(self.seq, tokens) - self.p0 + 1
        return TraceRows(self, len(tokens) - n_rows + 1 - self.p0, on, n_rows)

    def is_eog(self, token: int) -> bool:
        return token in self.eog


@dataclass
class Replayed:
    """What one replayed generation committed and what it cost."""

    tokens: list[int] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    errors: int = 0           # committed tokens that differ from the target's greedy token there
    first_error: int = -1     # position of the first one (-1: none)
    rounds: int = 0
    draft_n: int = 0
    seconds: float = 0.0
    calls: dict = field(default_factory=dict)
    guesses: int = 0          # decisions made on stand-in scores (0: calls and costs are exact too)


def replay(trace: Trace, slim: SlimTrace | None, mode: str, spec: SpecParams, cost: Cost, eog: Sequence[int],
           slim_model: str = "slim", n_ctx: int = 4096, lookup: CopyDrafter | None = None) -> Replayed:
    """Run `Decoder` on one trace under one configuration (greedy), priced by `cost`. `lookup`
    mode drafts with `lookup` (its policy's counts carry over between calls, as a slot's do in
    the engine), else with a fresh copy drafter pricing batches by `cost`."""
    info = mode_info(mode)
    target_tokens = [int(t) for t in trace.target]
    seq = list(trace.prompt) + target_tokens
    p0 = len(trace.prompt)
    meter, eog_set, fresh = Meter(cost), frozenset(eog), itertools.count(-1, -1)

    def model(role: str, name: str, top, score) -> TraceModel:
        return TraceModel(role, name, seq, p0, top, score, meter, eog_set, n_ctx, fresh)

    target = model("target", "target", target_tokens, np.zeros(len(target_tokens)))
    drafter = None
    if info.drafter == "lookup":
        drafter = lookup or CopyDrafter(copy_policy(cost))
    elif info.drafter == "model":
        drafter = ModelDrafter(model("draft", "draft", trace.draft, trace.draft_p))
    slim_m = model("slim", slim_model, slim.top, slim.ratio) if info.slim and slim is not None else None

    out, stats = Replayed(), Stats()

    def resync(i: int, tok: int) -> int | None:
        return target_tokens[i] if i < len(target_tokens) and tok != target_tokens[i] else None

    for c in Decoder(target, drafter, slim_m, spec).generate(
            seq[:p0], mode, GREEDY, len(target_tokens), stats, resync=resync):
        i = len(out.tokens)
        if c.token != target_tokens[i]:
            out.errors += 1
            out.first_error = i if out.first_error < 0 else out.first_error
        out.tokens.append(c.token)
        out.origins.append(c.origin)
        out.tiers.append(c.tier)
    out.rounds, out.draft_n = stats.rounds, stats.draft_n
    out.seconds, out.calls, out.guesses = meter.seconds, dict(meter.calls), meter.guesses
    return out


def copy_policy(cost: Cost, ctx: int = 384) -> CopyPolicy:
    """A copy policy pricing verifications with the target's row of the cost profile, as the
    engine's copy policy prices them with its measured batch costs (costs.verify_cost)."""
    return CopyPolicy(verify_cost(cost, ctx))


def predicted_agreement(error_rate: float, length: int) -> float:
    """Expected share of a `length`-token output before its first error, errors arriving at a
    constant per-token rate: the position-wise agreement a lossy mode keeps with the target
    (after a first difference, outputs rarely line up again)."""
    if error_rate <= 0:
        return 1.0
    q = 1.0 - error_rate
    return q * (1.0 - q ** length) / (error_rate * length)
