"""Constrained decoding: a grammar says which tokens may come next, and every mode chooses among
those; logit rules (bias, penalties) change the logits every mode chooses from.

The decoding loop's rows are wrapped (`Constraint.rows`): row i of an eval sees the grammar's
state after the committed text and the tokens before row i, and its `argmax`, `dist` and
`ratio` count only the tokens allowed there. So a drafted token the grammar forbids is rejected
at verification like any mismatch, and greedy constrained output is the same in every lossless
mode. The state itself moves only over committed tokens (`commit`); a round's look-ahead works
on a clone, so a rejected draft leaves nothing to roll back.

Per position the grammar is asked about as few tokens as possible: the row's best token first,
then its 64 best, the full vocabulary only when none of those is allowed (docs/benchmarks.md has
the cost per token).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..llama import GrammarState
from .sampling import Dist, SamplingParams, dist
from .scores import LogitRows

SHORTLIST = 64  # candidates checked before the full vocabulary
REPEAT_LAST_N = 64  # llama.cpp's penalty_last_n default


def grammar_text(grammar: str | None = None, response_format: Mapping[str, Any] | None = None) -> str | None:
    """The GBNF for a request: a grammar as given, or one made from OpenAI's `response_format`
    (`json_object`, optionally with a `schema` as llama-server takes it, or `json_schema`)."""
    if grammar is not None and response_format is not None and response_format.get("type") != "text":
        raise InvalidParameterError("give 'grammar' or 'response_format', not both", "grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidParameterError("'grammar' must be a non-empty GBNF string", "grammar")
        return grammar
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return schema_grammar(schema) if schema is not None else _json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise InvalidParameterError("'response_format.json_schema' must be an object with a 'schema' object",
                                        "response_format")
        return schema_grammar(spec.get("schema", {}))
    raise InvalidParameterError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                                "response_format")


def _json_object() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def schema_grammar(schema: Any, param: str = "response_format", prop_order: Sequence[str] = ()) -> str:
    """GBNF for JSON matching `schema` (llama-cpp-python's converter; `param` names the request field)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if not isinstance(schema, Mapping):
        raise InvalidParameterError("a JSON schema must be an object", param)
    try:
        return json_schema_to_gbnf(json.dumps(schema), prop_order=list(prop_order))
    except Exception as exc:  # the converter raises bare exceptions for what it does not support
        raise InvalidParameterError(f"the JSON schema cannot be turned into a grammar: {exc}", param) from None


@dataclass(frozen=True)
class LogitRules:
    """OpenAI's `logit_bias` and presence/frequency penalties, llama.cpp's repeat penalty: changes
    to the logits that depend on the text so far, made alike to target and draft rows.

    Presence and frequency count the answer so far (OpenAI); the repeat penalty covers the last
    `REPEAT_LAST_N` tokens of the whole context and divides a positive logit, multiplies a
    negative one (llama.cpp's `penalty_repeat`, `penalty_last_n` 64). Bias first, then penalties.
    """

    bias: tuple[tuple[int, float], ...] = ()
    presence: float = 0.0
    frequency: float = 0.0
    repeat: float = 1.0

    @classmethod
    def make(cls, n_vocab: int, logit_bias: Mapping[Any, float] | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repeat_penalty: float = 1.0) -> "LogitRules | None":
        """Checked rules, or None when they change nothing."""
        bias = []
        for key, value in (logit_bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidParameterError(f"logit_bias keys are token ids, got {key!r:.20}", "logit_bias") from None
            if not 0 <= token < n_vocab:
                raise InvalidParameterError(f"logit_bias token {token} is not in 0..{n_vocab - 1}", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise InvalidParameterError(f"logit_bias values must be in -100..100, got {value!r:.20}",
                                            "logit_bias")
            bias.append((token, float(value)))
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise InvalidParameterError(f"{name} must be in -2..2, got {value!r:.20}", name)
        if isinstance(repeat_penalty, bool) or not isinstance(repeat_penalty, (int, float)) or \
                not 0 < repeat_penalty <= 10:
            raise InvalidParameterError(f"repeat_penalty must be in (0, 10], got {repeat_penalty!r:.20}",
                                        "repeat_penalty")
        rules = cls(tuple(sorted(bias)), float(presence_penalty), float(frequency_penalty), float(repeat_penalty))
        return rules if rules != cls() else None

    def apply(self, logits: np.ndarray, answer: Sequence[int], recent: Sequence[int],
              tokens: Sequence[int]) -> np.ndarray:
        """A changed copy of `logits`, whose row i follows the text so far and tokens[:i]: `answer`
        is the answer so far, `recent` the context's last REPEAT_LAST_N tokens."""
        out = np.array(logits, dtype=np.float32)
        if self.bias:
            ids, values = zip(*self.bias)
            out[:, list(ids)] += np.array(values, dtype=np.float32)
        counts = Counter(answer) if self.presence or self.frequency else None
        window = list(recent)
        for i in range(len(out)):
            if i:
                if counts is not None:
                    counts[tokens[i - 1]] += 1
                window.append(tokens[i - 1])
            row = out[i]
            if self.repeat != 1.0:
                ids = np.fromiter(set(window[-REPEAT_LAST_N:]), dtype=np.int64)
                x = row[ids]
                row[ids] = np.where(x > 0, x / np.float32(self.repeat), x * np.float32(self.repeat))
            if counts:
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                row[ids] -= np.float32(self.presence) + np.float32(self.frequency) * c
        return out


class Constraint:
    """What every chosen token of one generation obeys: a grammar (its state after the committed
    text), logit rules, or both."""

    def __init__(self, state: GrammarState | None = None, rules: LogitRules | None = None) -> None:
        self.state, self.rules = state, rules
        self.n_prompt = self.n_committed = 0  # context tokens the state has seen (the prompt counts, unparsed)

    def start(self, prompt_len: int) -> None:
        self.n_prompt = self.n_committed = prompt_len

    def commit(self, token: int) -> None:
        if self.state is not None:
            self.state.accept(token)
        self.n_committed += 1

    def allows(self, ctx: Sequence[int], token: int) -> bool:
        """May `token` follow `ctx` (the committed text and what this round added to it)?"""
        return self.allowed_prefix(ctx, [token]) == 1

    def allowed_prefix(self, ctx: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order after `ctx`, the grammar allows."""
        if self.state is None:
            return len(tokens)
        look = ConstrainedRows(None, self.state, list(ctx[self.n_committed:]), tokens)
        n = 0
        while n < len(tokens) and look.allowed(n, tokens[n]):
            n += 1
        return n

    def rows(self, rows, ctx: Sequence[int], tokens: Sequence[int] = (), after: Sequence[int] = ()):
        """`rows` of an eval whose row 0 follows ctx + after and row i follows ctx + after + tokens[:i]."""
        if self.rules is not None:
            answer = list(ctx[self.n_prompt:]) + list(after)
            recent = (list(ctx[-REPEAT_LAST_N:]) + list(after))[-REPEAT_LAST_N:]
            rows = LogitRows(self.rules.apply(rows.logits, answer, recent, tokens))
        if self.state is None:
            return rows
        return ConstrainedRows(rows, self.state, list(ctx[self.n_committed:]) + list(after), tokens)


class ConstrainedRows:
    """Scores of logits rows restricted to what the grammar allows at each row's position."""

    def __init__(self, rows, state: GrammarState, lead: list[int], tokens: Sequence[int]) -> None:
        self._rows, self._base, self._lead, self._tokens = rows, state, lead, tokens
        self._state: GrammarState | None = None
        self._at = 0          # the row `_state` is at
        self._dead = False    # a token on the way there was not allowed: nothing is

    def __len__(self) -> int:
        return len(self._rows)

    def _state_at(self, i: int) -> GrammarState | None:
        if self._state is None or i < self._at:
            self._state, self._at, self._dead = self._base.clone(), 0, False
            for tok in self._lead:  # this round's tokens before row 0
                self._advance(tok)
        while self._at < i and not self._dead:  # a dead state stays dead
            self._advance(self._tokens[self._at])
            self._at += 1
        return None if self._dead else self._state

    def _advance(self, token: int) -> None:
        try:
            self._state.accept(token)
        except ValueError:
            self._dead = True

    def _live(self, i: int) -> GrammarState:
        state = self._state_at(i)
        if state is None:
            raise RuntimeError("asked for a row past a token the grammar forbids")
        return state

    def _masked(self, state: GrammarState, i: int) -> np.ndarray:
        """Row i with every token the grammar forbids at -inf: a pass over the whole vocabulary."""
        masked = state.mask(self._rows.logits[i])
        if not np.isfinite(masked).any():
            raise InvalidParameterError("the grammar allows no token here (it can neither go on nor end)")
        return masked

    def allowed(self, i: int, token: int) -> bool:
        state = self._state_at(i)
        return state is not None and bool(state.allowed(np.array([token], dtype=np.int32))[0])

    def argmax(self, i: int) -> int:
        row = self._rows.logits[i]
        best = int(row.argmax())
        if self.allowed(i, best):
            return best
        state = self._live(i)
        top = np.argpartition(row, row.size - SHORTLIST)[row.size - SHORTLIST:]
        top = top[np.argsort(-row[top], kind="stable")].astype(np.int32)
        ok = state.allowed(top)
        if ok.any():
            return int(top[int(ok.argmax())])
        return int(self._masked(state, i).argmax())

    def ratio(self, i: int, token: int) -> float:
        """p(token) / max p over the allowed tokens (0 if the grammar forbids it): routing compares
        a draft with what the model could have said here."""
        if not self.allowed(i, token):
            return 0.0
        row = self._rows.logits[i]
        return float(np.exp(np.float32(row[token]) - np.float32(row[self.argmax(i)])))

    def top_prob(self, i: int) -> float:
        return self._rows.top_prob(i)

    def logprobs(self, i: int, token: int, n: int):
        return self._rows.logprobs(i, token, n)  # before the grammar, as OpenAI reports them

    def dist(self, i: int, sp: SamplingParams) -> Dist:
        """The filters' candidates the grammar allows, renormalised; when the filters kept none of
        them (or kept the whole vocabulary), the grammar first and the filters on what it allows."""
        state = self._live(i)
        d = self._rows.dist(i, sp)
        if d.ids is not None:
            ok = state.allowed(d.ids.astype(np.int32))
            if ok.any():
                p = d.p[ok]
                return Dist(p / np.float32(p.sum(dtype=np.float64)), d.ids[ok])
        return dist(self._masked(state, i), sp)
