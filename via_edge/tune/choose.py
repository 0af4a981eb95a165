"""From replays to a choice: the grid of configurations, their predicted speed and fidelity, the
frontier, and the never-slower rule.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

from ..bench.metrics import geomean
from ..decode.copying import CopyDrafter
from ..decode.costs import CostProfile
from ..decode.modes import LOSSLESS
from ..decode.spec import SpecParams
from .record import SlimTrace, Trace
from .replay import copy_policy, predicted_agreement, replay


@dataclass
class Candidate:
    """One configuration and what the replay predicts for it on the calibration traces."""

    mode: str
    spec: SpecParams
    slim: str | None = None        # slim layers, for via and hier
    speedup: float = 1.0           # geometric mean over traces of predicted ar time / mode time
    tok_s: float = 0.0             # predicted tokens per second over all traces
    error_rate: float = 0.0        # committed tokens differing from the target's (via only)
    fidelity: float = 1.0          # predicted position-wise agreement at the output length
    tiers: dict = field(default_factory=dict)
    format: str = "shipped"        # the weight format of target and slim (weights/formats.py)

    @property
    def lossless(self) -> bool:
        return self.mode in LOSSLESS

    def label(self) -> str:
        s, d = self.spec, SpecParams()
        knobs = {"n_draft": s.n_draft, "p_min": s.p_min}
        if self.mode == "via":
            knobs.update(tau_accept=s.tau_accept, tau_full=s.tau_full)
        if self.mode == "hier":
            knobs.update(tau_full=s.tau_full, hier_block=s.hier_block)
        if self.mode == "lookup":
            knobs = {"copy_max": s.copy_max, "ngram_min": s.ngram_min}
        if self.mode == "ar":
            knobs = {}
        parts = [f"{k} {v}" for k, v in knobs.items() if v != getattr(d, k) or k == "n_draft"]
        where = [] if self.format == "shipped" else [f"on {self.format}"]
        return " ".join([self.mode] + ([f"slim {self.slim}"] if self.slim else []) + parts + where)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["label"] = self.label()
        return out


def grid(slims: Sequence[str]) -> Iterable[tuple[str, SpecParams, str | None]]:
    """Every configuration the tuner predicts (about 800; a replay of all takes seconds)."""
    yield "ar", SpecParams(), None
    # copy_max stays at its default (63): the calibration prompts copy too little to judge drafts
    # longer than the profile's 16 rows, and the live policy sizes them from tile costs measured to 64
    for ngram_min in (1, 2):
        yield "lookup", SpecParams(ngram_min=ngram_min), None
    for n in (1, 2, 3, 4, 6, 7, 8, 15):  # 3, 7, 15: verification batches of 4, 8 and 16 rows (kernel blocks)
        for p_min in (0.0, 0.5, 0.7, 0.9):
            yield "sd", SpecParams(n_draft=n, p_min=p_min), None
    for slim in slims:
        for n, tf, hb, p_min in itertools.product((2, 4, 6), (0.1, 0.3, 0.5, 0.7), (4, 8, 12), (0.0, 0.7)):
            yield "hier", SpecParams(n_draft=n, tau_full=tf, hier_block=hb, p_min=p_min), slim
        for n, ta, tf, p_min in itertools.product((2, 3, 4, 6), (0.5, 0.7, 0.9, 0.97), (0.1, 0.3, 0.5, 0.7),
                                                  (0.0, 0.7)):
            if tf <= ta:
                yield "via", SpecParams(n_draft=n, tau_accept=ta, tau_full=tf, p_min=p_min), slim


def predict(traces: Sequence[Trace], slim_traces: dict[str, list[SlimTrace]], slim_model: dict[str, str],
            cost: Callable[[str, int, int], float], eog: Sequence[int], out_length: int,
            configs: Iterable[tuple[str, SpecParams, str | None]], *, fmt: str = "shipped",
            baseline: Callable[[str, int, int], float] | None = None) -> list[Candidate]:
    """Replay every configuration on every trace, as ratios to `ar` on the same trace; `ar`
    priced by `baseline` (default `cost`), the shipped format's costs when `fmt` is a variant."""
    ar_seconds = [replay(t, None, "ar", SpecParams(), baseline or cost, eog).seconds for t in traces]
    out = []
    for mode, spec, slim in configs:
        lookup = CopyDrafter(copy_policy(cost)) if mode == "lookup" else None  # learns over the traces
        runs = [replay(t, slim_traces[slim][i] if slim else None, mode, spec, cost, eog,
                       slim_model=slim_model.get(slim, "slim"), lookup=lookup)
                for i, t in enumerate(traces)]
        tokens = sum(len(r.tokens) for r in runs)
        seconds = sum(r.seconds for r in runs)
        errors = sum(r.errors for r in runs)
        err = errors / tokens if tokens else 0.0
        tiers = {k: sum(r.tiers.count(k) for r in runs) / tokens for k in "ABC"} if tokens else {}
        out.append(Candidate(mode, spec, slim, geomean([a / r.seconds for a, r in zip(ar_seconds, runs)]),
                             tokens / seconds if seconds else 0.0, err, predicted_agreement(err, out_length),
                             tiers, fmt))
    return out


def frontier(cands: Sequence[Candidate]) -> list[Candidate]:
    """The configurations no other beats on both predicted speed and fidelity."""
    best, out = -1.0, []
    for c in sorted(cands, key=lambda c: (-c.fidelity, -c.speedup)):
        if c.speedup > best:
            out.append(c)
            best = c.speedup
    return out


def best_per_mode(cands: Sequence[Candidate], floor: float, fmt: str | None = None) -> dict[str, Candidate]:
    """Per mode, the fastest configuration meeting the fidelity floor (lossless modes always do),
    over every format or only `fmt`."""
    out: dict[str, Candidate] = {}
    for c in cands:
        if fmt is not None and c.format != fmt:
            continue
        if not c.lossless and c.fidelity < floor:
            continue
        if c.mode not in out or c.speedup > out[c.mode].speedup:
            out[c.mode] = c
    return out


PREDICTED_MARGIN = 0.15  # speculation must be predicted this much faster than ar ...
MEASURED_MARGIN = 0.05   # ... and measured this much faster on held-out prompts


def choose(best: dict[str, Candidate], baseline: Candidate, margin: float = PREDICTED_MARGIN) -> Candidate:
    """The never-slower rule: anything but `baseline` (ar on the shipped file) only when predicted
    at least `margin` faster than it; `best` holds per mode the fastest over every format.

    The margin is the prediction's error on unseen prompts, not on the calibration ones: on this
    project's reference machine the full benchmark (13 categories, 128 tokens) measured 10-18%
    below the replay's predictions (docs/benchmarks.md, section 9), while held-out checks of 48
    tokens agreed within 6%.
    """
    top = max(best.values(), key=lambda c: c.speedup, default=baseline)
    return top if top.speedup >= 1.0 + margin else baseline


def slim_bound(profile: CostProfile, ctx: int) -> float:
    """The most any slim mode could gain over ar: every draft token kept and checked by a one-block
    slim, the target never called (via's best case; hier always calls the target, so it gains less)."""
    ar = profile.cost("target", 1, ctx)
    per_token = min((k * profile.cost("draft", 1, ctx) + profile.slim_cost(1, k + 1, ctx)) / (k + 1)
                    for k in range(1, max(profile.batches)))
    return ar / per_token


SCREEN_FLOOR = 1.0  # a slim mode predicted slower than ar on the search's prompts is not scored further


def slim_screen(traces: Sequence[Trace], slim_traces: dict[str, list[SlimTrace]], slim_model: dict[str, str],
                cost: Callable[[str, int, int], float], eog: Sequence[int], out_length: int,
                floor: float) -> Candidate | None:
    """The fastest slim configuration (via or hier) meeting the fidelity floor on the search's own
    traces: where even it is slower than ar, no slim mode can be chosen (that takes +15% over ar on
    every calibration prompt), and the finalists' scoring on all of them is time for nothing."""
    cands = predict(traces, slim_traces, slim_model, cost, eog, out_length,
                    [g for g in grid(list(slim_traces)) if g[2] is not None])
    return max(best_per_mode(cands, floor).values(), key=lambda c: c.speedup, default=None)


def screened_out(screen: Candidate | None, n_prompts: int, floor: float = SCREEN_FLOOR) -> str | None:
    """Why the slim finalists are not scored on every calibration prompt, or None when they are."""
    if screen is not None and screen.speedup >= floor:
        return None
    return (f"slim finalists not scored on every calibration prompt: on the {n_prompts} search prompts "
            + (f"the fastest slim configuration, {screen.label()}, is predicted at {screen.speedup:.2f}x ar"
               if screen else "no slim configuration meets the fidelity floor")
            + f" (below {floor:.2f}x), and a slim mode is chosen only at +{PREDICTED_MARGIN:.0%} over ar on all of them")


def worth_checking(best: dict[str, Candidate], below: dict[str, Candidate], chosen: Candidate
                   ) -> tuple[dict[str, Candidate], list[str]]:
    """The modes whose real run can change `final_choice`: the favourite, every mode that may stand
    in for it (predicted past the margin), and ar and lookup (the copy rule weighs the two). The
    others' held-out runs could not change the choice (nor can a mode `below` the fidelity floor),
    so they are left out, with why."""
    keep = {m: c for m, c in best.items()
            if m == chosen.mode or m in ("ar", "lookup") or c.speedup >= 1.0 + PREDICTED_MARGIN}
    why = [f"{m} not run on the held-out prompts: predicted {c.speedup:.2f}x ar, below the "
           f"+{PREDICTED_MARGIN:.0%} a mode needs to be chosen" for m, c in best.items() if m not in keep]
    why += [f"{m} not run on the held-out prompts: no configuration meets the fidelity floor" for m in below]
    return keep, why


def final_choice(chosen: Candidate, best: dict[str, Candidate], checks: dict, floor: float, baseline: Candidate
                  ) -> tuple[Candidate, str]:
    """Keep the predicted choice only if the real run agrees it is clearly faster than ar on the
    shipped file (never slower). `best` and `checks` are per mode on the choice's format."""
    def is_base(c: Candidate) -> bool:
        return c.mode == "ar" and c.format == baseline.format

    def ok(m: str) -> bool:
        c = checks.get(m)
        return m in best and bool(c) and c["measured_speedup"] >= 1.0 + MEASURED_MARGIN and (
            best[m].lossless or c["measured_agreement"] >= floor)

    if not is_base(chosen) and ok(chosen.mode):
        c = checks[chosen.mode]
        return chosen, (f"chose {chosen.label()}: predicted {chosen.speedup:.2f}x, measured {c['measured_speedup']:.2f}x "
                        f"over ar on the shipped file on held-out prompts")
    # another mode may stand in for the favourite only if it, too, clears the predicted margin
    measured = [m for m in checks if m in best and not is_base(best[m]) and ok(m)
                and best[m].speedup >= 1.0 + PREDICTED_MARGIN]
    if measured:
        m = max(measured, key=lambda m: checks[m]["measured_speedup"])
        return best[m], (f"chose {best[m].label()}: measured {checks[m]['measured_speedup']:.2f}x over ar on the "
                         f"shipped file on held-out prompts (the predicted favourite, {chosen.label()}, was not "
                         f"faster in the real run)")
    fastest = max((c for c in best.values() if not is_base(c)), key=lambda c: c.speedup, default=None)
    detail = (f"; the best other configuration, {fastest.label()}, is predicted at {fastest.speedup:.2f}x"
              + (f" and measured at {checks[fastest.mode]['measured_speedup']:.2f}x" if fastest.mode in checks else "")
              if fastest else "")
    return baseline, (f"nothing beats plain decoding (ar) on the shipped file on this machine by the margins the "
                      f"never-slower rule asks (predicted +{PREDICTED_MARGIN:.0%}, measured +{MEASURED_MARGIN:.0%})"
                      f"{detail}: chose ar")


NOT_SLOWER = 0.98  # lookup replaces ar when measured at least this fast as ar on held-out prompts


def copy_drafting_over_ar(final: Candidate, why: str, best: dict[str, Candidate], checks: dict, fmt: str
                           ) -> tuple[Candidate, str]:
    """Where the choice is plain decoding, copy-aware drafting (`lookup`) takes its place if the
    real run finds it no slower: it abstains where the text copies nothing (an `ar` round) and
    pays several times over on answers that rewrite their prompt, which calibration prompts
    rarely are (docs/benchmarks.md, section 20)."""
    look, plain = checks.get("lookup"), checks.get("ar")
    if final.mode != "ar" or final.format != fmt or "lookup" not in best or not look:
        return final, why
    plain_speed = plain["measured_speedup"] if plain else 1.0
    if look["measured_speedup"] < NOT_SLOWER * plain_speed:
        return final, why
    return best["lookup"], (f"{why}; lookup in its place: measured {look['measured_speedup']:.2f}x against ar's "
                            f"{plain_speed:.2f}x on held-out prompts (no slower where nothing is copied, "
                            f"several times faster where the answer copies its prompt)")
