"""`via-edge tune`: measure this machine, search the slim, predict every configuration offline,
check the prediction with a real run, and store the choice the engine then uses by default.

    formats   -> weight-format variants of target and draft: cost at 1..16 tokens, quality
                 against the shipped file; the draft's fastest passing format is used from here on
    profile   -> CostProfile (decode cost of draft, slims, target by batch and context)
    record    -> traces: the target's greedy output on calibration prompts, the draft along it
    search    -> slim layers (agreement with the target along the traces, under a block budget)
    predict   -> replay ~800 configurations on the shipped file and each passing format (a format's
                 costs are the shipped profile times its measured cost ratio per batch size)
    choose    -> fastest (format, mode, knobs) meeting both floors, or ar on the shipped file
    verify    -> real interleaved run on held-out prompts: predicted vs measured speedup
"""

from __future__ import annotations

import datetime as _dt
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .. import formats
from .. import models as catalog
from ..bench.metrics import fidelity, geomean
from ..spec import SpecParams
from ..engine import Engine
from ..derived import derived_files, in_use, remove
from ..errors import InvalidParameterError, ViaEdgeError
from ..gguf_info import read_info
from ..llama import LlamaModel, LoadParams, default_threads
from ..machine import machine, machine_key, versions
from ..slim import build_slim, format_layers, is_prefix
from ..files import write_json
from ..tuned import TunedConfig, load_choice, tuned_path
from . import profile as prof
from .choose import MEASURED_MARGIN, PREDICTED_MARGIN, Candidate, best_per_mode, choose, frontier, grid, predict
from ..prompts import chat_tokens
from .record import calibration_prompts, capture_names, record, slim_traces
from .search import Search
from .survey import QUALITY_FLOOR, FormatRow, check_floor, pick, survey, table


@dataclass
class TuneConfig:
    pair: str | None = None
    fidelity_floor: float = 0.95   # via must keep this predicted agreement with the target's greedy output
    out_length: int = 128          # output length that agreement is predicted for
    calib_tokens: int = 48         # target tokens recorded per calibration prompt
    search_prompts: int = 6        # calibration prompts the slim search scores on (the shortest)
    search_evals: int = 20         # slims the search may build and score (about 23 s each here)
    slim_budget: float = 0.75      # a slim may cost at most this share of the target's verify call
    heldout: int = 4               # held-out prompts for the real check
    verify_tokens: int = 48
    repeats: int = 2               # profile repeats (medians kept)
    contexts: tuple[int, ...] = prof.CONTEXTS
    batches: tuple[int, ...] = prof.BATCHES
    n_ctx: int = 4096
    threads: int | None = None
    formats: tuple[str, ...] = field(default_factory=formats.default_formats)  # tried (shipped always)
    quality_floor: float = QUALITY_FLOOR  # a format's teacher-forced agreement with the shipped file
    replace: bool = False          # replace a stored choice made over formats this run does not try
    load: dict = field(default_factory=dict)  # extra LoadParams (tests: exact kernels)
    out: Path | None = None        # report folder (default: next to the tuned files)


class Log:
    def __init__(self, quiet: bool) -> None:
        self.quiet, self.t0 = quiet, time.monotonic()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            sys.stderr.write(f"[{time.monotonic() - self.t0:6.0f}s] {msg}\n")
            sys.stderr.flush()


def tune(cfg: TuneConfig, quiet: bool = False) -> dict:
    log = Log(quiet)
    pair = catalog.pair(cfg.pair)
    name = pair["name"]
    if not 0 < cfg.fidelity_floor <= 1:
        raise InvalidParameterError(f"--fidelity-floor must be in (0, 1], got {cfg.fidelity_floor}")
    if not 0 < cfg.slim_budget < 1:
        raise InvalidParameterError(f"--slim-budget must be in (0, 1), got {cfg.slim_budget}")
    check_floor(cfg.quality_floor)
    formats.check_names(list(cfg.formats))
    stored = load_choice(name)
    missing = sorted(set(stored.formats) - set(cfg.formats)) if stored else []
    if missing and not cfg.replace:
        raise ViaEdgeError(f"the tuned choice for {name} on this machine was made over the formats "
                           f"{', '.join(stored.formats)}; this run would not try {', '.join(missing)}, so "
                           "it may not replace that choice: add --replace to replace it anyway")
    threads = cfg.threads or default_threads()
    load = LoadParams(n_ctx=cfg.n_ctx, n_threads=threads, **cfg.load)
    target_path = catalog.resolve(pair["target"], pull_missing=True)
    draft_path = (catalog.resolve(pair["draft"], pull_missing=True) if pair.get("draft")
                  else build_slim(target_path, pair["draft_layers"]))
    before = {d.path for d in derived_files()}  # what this run makes and does not choose is removed
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    if read_info(target_path).block_count < 2:
        raise InvalidParameterError(f"{target_path.name} has fewer than 2 blocks: there is no slim to search")

    cal = calibration_prompts(1)
    spare = calibration_prompts(1, skip=1)
    held = spare[:: max(1, len(spare) // cfg.heldout)][: cfg.heldout]  # spread over the categories
    with LlamaModel(target_path, load) as target:
        cal_tokens = [chat_tokens(target, [{"role": "user", "content": p.text}]) for p in cal]

    # 0. weight formats ----------------------------------------------------------------------------
    t0 = time.monotonic()
    sources = {"target": target_path, **({"draft": draft_path} if pair.get("draft") else {})}
    fmt_rows: dict[str, list[FormatRow]] = {}
    if set(cfg.formats) - {formats.SHIPPED}:
        log(f"formats {', '.join(cfg.formats)} of {', '.join(sources)}: deriving (cached), quality, costs")
        short = sorted(cal_tokens, key=len)[: cfg.search_prompts]  # quality on the shortest: prefill is slow here
        fmt_rows = survey(sources, cfg.formats, short, load, continuation=cfg.calib_tokens, log=log)
        for role, rows in fmt_rows.items():
            log(f"  {role}: " + "; ".join(f"{r.format} {r.cost[1] * 1e3:.0f} ms/token"
                                         + (f", agreement {r.quality.agreement:.3f}" if r.quality else "")
                                         for r in rows))
    draft_fmt = pick(fmt_rows["draft"], cfg.quality_floor) if "draft" in fmt_rows else None
    if draft_fmt is not None:
        draft_path = draft_fmt.path
    # a passing target format's cost, per batch size, as a ratio to the shipped file's
    shipped_row = fmt_rows["target"][0] if fmt_rows else None
    ratios = {r.format: {n: r.cost[n] / shipped_row.cost[n] for n in r.cost}
              for r in fmt_rows.get("target", [])[1:] if r.clears(cfg.quality_floor)}
    timings["formats"] = time.monotonic() - t0

    with LlamaModel(target_path, load) as target, LlamaModel(draft_path, load) as draft:
        n_blocks = target.n_layer
        eog = [t for t in range(target.n_vocab) if target.is_eog(t)]

        # 1. cost profile --------------------------------------------------------------------------
        t0 = time.monotonic()
        sizes = sorted({max(1, round(n_blocks * f)) for f in (0.4, 0.7)} - {n_blocks})  # + target: 3 points
        slim_files = {f"slim-{k}": build_slim(target_path, f"0-{k - 1}") for k in sizes}
        models = {"target": target, "draft": draft}
        opened = {key: LlamaModel(path, load) for key, path in slim_files.items()}
        try:
            models.update(opened)
            fill = [t for p in cal_tokens for t in p]
            log(f"profiling {', '.join(models)}: batches {cfg.batches[0]}..{cfg.batches[-1]}, contexts "
                f"{', '.join(map(str, cfg.contexts))}, {cfg.repeats} repeats")
            profile = prof.measure(models, fill, batches=cfg.batches, contexts=cfg.contexts, repeats=cfg.repeats)
        finally:
            for m in opened.values():
                m.close()
        profile.meta = {"pair": name, "machine": machine_key(), "cpu": machine()["cpu"], "threads": threads,
                        "date": _now(), "load": {k: v for k, v in asdict(load).items() if k != "capture"},
                        "fit_error": profile.fit_error()}
        write_json(tuned_path(name, "profile"), profile.to_dict())
        timings["profile"] = time.monotonic() - t0
        log(f"profile: target {_ms(profile, 'target', 1)} ms/token alone, {_ms(profile, 'target', 8)} ms for 8; "
            f"draft {_ms(profile, 'draft', 1)} ms; slim cost by block count within {profile.meta['fit_error']['median']:.0%} "
            f"(median; worst point {profile.meta['fit_error']['max']:.0%})")

        # 2. record ---------------------------------------------------------------------------------
        t0 = time.monotonic()
        traces = record(target, draft, cal_tokens, cfg.calib_tokens)
        timings["record"] = time.monotonic() - t0
        draft_agree = float(np.mean(np.concatenate([t.draft == t.target for t in traces])))
        log(f"recorded {len(traces)} calibration prompts x {cfg.calib_tokens} tokens; draft agrees with the "
            f"target on {draft_agree:.2f} of them")

    # 3. slim search ------------------------------------------------------------------------------
    t0 = time.monotonic()
    verify_cost = profile.cost("target", SpecParams().n_draft + 1, cfg.contexts[1])
    budget = max((k for k in range(1, n_blocks)
                  if profile.slim_cost(k, SpecParams().n_draft + 1, cfg.contexts[1]) <= cfg.slim_budget * verify_cost),
                 default=1)  # even one block over budget: search the cheapest slims anyway, the replay decides
    order = sorted(range(len(traces)), key=lambda i: len(traces[i].prompt))
    search_set = [traces[i] for i in order[: cfg.search_prompts]]
    scratch = Path(tempfile.mkdtemp(prefix="via-edge-search-", dir=catalog.model_dir()))
    try:
        def evaluate(layers, want_influence):
            path = build_slim(target_path, format_layers(layers), scratch / f"{format_layers(layers)}.gguf")
            extra_load = replace(load, capture=capture_names(len(layers)) if want_influence else ())
            with LlamaModel(path, extra_load) as slim:
                sts, infl = slim_traces(slim, search_set, hidden=want_influence)
            path.unlink()
            return _agreement(search_set, sts), _routing(search_set, sts), infl

        log(f"searching slims of at most {budget} of {n_blocks} blocks (slim cost <= {cfg.slim_budget:.0%} of the "
            f"target's verify call), {cfg.search_evals} evaluations on {len(search_set)} prompts")
        search = Search(n_blocks, budget, evaluate, max_evals=cfg.search_evals, log=log)
        ranked = search.run()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    timings["search"] = time.monotonic() - t0

    # finalists, scored on every calibration prompt
    finalists = _finalists(ranked)
    slim_data, slim_model, slim_scores = {}, {}, []
    for s in finalists:
        spec_s = format_layers(s.layers)
        with LlamaModel(build_slim(target_path, spec_s), load) as slim:
            slim_data[spec_s], _ = slim_traces(slim, traces)
        slim_model[spec_s] = f"slim-{len(s.layers)}"
        slim_scores.append({"layers": spec_s, "blocks": len(s.layers), "strategy": s.strategy,
                            "search_agreement": s.agreement, "agreement": _agreement(traces, slim_data[spec_s]),
                            **_routing(traces, slim_data[spec_s])})
    log("finalists: " + "; ".join(f"{d['layers']} agreement {d['agreement']:.2f}" for d in slim_scores))

    # 4. predict and choose ------------------------------------------------------------------------
    t0 = time.monotonic()
    cands = predict(traces, slim_data, slim_model, profile.cost, eog, cfg.out_length, grid(list(slim_data)))
    best = best_per_mode(cands, cfg.fidelity_floor)
    # the engine loads one slim: the one of the faster slim mode; the other mode is tuned for it too
    slim_modes = [best[m] for m in ("via", "hier") if m in best]
    slim_layers = max(slim_modes, key=lambda c: c.speedup).slim if slim_modes else None
    usable = [c for c in cands if c.slim in (None, slim_layers)]
    for fmt, ratio in ratios.items():  # every mode again on each passing format, with the chosen slim
        usable += predict(traces, slim_data, slim_model, profile.scaled(ratio), eog, cfg.out_length,
                          grid([slim_layers] if slim_layers else []), fmt=fmt, baseline=profile.cost)
    baseline = next(c for c in cands if c.mode == "ar")
    best = best_per_mode(usable, cfg.fidelity_floor)
    chosen = choose(best, baseline)
    timings["predict"] = time.monotonic() - t0
    log(f"predicted {len(usable)} configurations in {timings['predict']:.0f}s; best per mode: "
        + ", ".join(f"{c.label()} {c.speedup:.2f}x" for c in best.values()))
    # the real check runs every mode on the format of the predicted choice, against ar on the shipped file
    fmt = chosen.format
    best = best_per_mode(usable, cfg.fidelity_floor, fmt=fmt)
    # a lossy mode with nothing above the floor keeps (and is checked at) its most faithful configuration
    below = {m: max((c for c in usable if c.mode == m and c.format == fmt), key=lambda c: (c.fidelity, c.speedup))
             for m in ("via",) if m not in best and any(c.mode == m and c.format == fmt for c in usable)}
    fmt_path = formats.derive(target_path, fmt)

    # 5. verify with a real run ----------------------------------------------------------------------
    t0 = time.monotonic()
    checks = verify(fmt_path, draft_path, {**best, **below}, held, cfg, load, log,
                    baseline=target_path if fmt != formats.SHIPPED else None)
    timings["verify"] = time.monotonic() - t0
    final, why = _final_choice(chosen, best, checks, cfg.fidelity_floor, baseline)
    final, why = _copy_drafting_over_ar(final, why, best, checks, fmt)
    log(why)

    # 6. store -------------------------------------------------------------------------------------
    if final.format != fmt:  # fell back to ar on the shipped file: keep the shipped format's knobs
        best = best_per_mode(usable, cfg.fidelity_floor, fmt=final.format)
        below = {}
    modes = {m: asdict(c.spec) for m, c in {**best, **below}.items()}
    choice = TunedConfig(name, final.mode, slim_layers, modes, why, target_format=final.format,
                         draft_format=draft_fmt.format if draft_fmt else formats.SHIPPED,
                         formats=sorted(set(cfg.formats) | {formats.SHIPPED}))
    timings["total"] = time.monotonic() - t_start
    result = {
        "meta": {"date": _now(), "pair": name, "machine": {**machine(), "threads_used": threads,
                                                            "key": machine_key()},
                 "versions": versions(), "config": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in asdict(cfg).items()},
                 "calibration": [p.id for p in cal], "heldout": [p.id for p in held],
                 "timings": timings, "draft_agreement": draft_agree, "block_budget": budget,
                 "n_blocks": n_blocks},
        "formats": {role: [r.to_dict() for r in rows] for role, rows in fmt_rows.items()},
        "formats_table": table(fmt_rows, cfg.quality_floor) if fmt_rows else "",
        "profile": profile.to_dict(),
        "search": [{"layers": format_layers(s.layers), "blocks": len(s.layers), "strategy": s.strategy,
                    "agreement": s.agreement, **s.extra} for s in search.scored.values()],
        "finalists": slim_scores,
        "candidates": [c.to_dict() for c in cands + [c for c in usable if c.format != formats.SHIPPED]],
        "frontier": [c.label() for c in frontier(cands + [c for c in usable if c.format != formats.SHIPPED])],
        "best": {m: c.to_dict() for m, c in best.items()},
        "below_floor": {m: c.to_dict() for m, c in below.items()},
        "predicted_choice": chosen.to_dict(),
        "verify": checks,
        "choice": choice.to_dict(),
    }
    write_json(tuned_path(name, "choice"), choice.to_dict())
    result["paths"] = {"profile": str(tuned_path(name, "profile")), "choice": str(tuned_path(name, "choice"))}
    made = derived_files()
    used = in_use(made)
    dropped = [d for d in made if d.path not in before and d.path not in used]
    freed = sum(remove(d.path) for d in dropped)
    if dropped:
        log(f"removed {len(dropped)} files this run made and did not choose ({freed / 1e9:.1f} GB): "
            + ", ".join(d.kind for d in dropped))
    result["removed"] = [str(d.path) for d in dropped]
    return result


BASE = "ar (shipped)"  # the baseline's key in the checks when the choice is on another format


def verify(target_path: Path, draft_path: Path, best: dict[str, Candidate], prompts, cfg: TuneConfig,
           load: LoadParams, log: Callable[[str], None], baseline: Path | None = None) -> dict:
    """Each mode's best configuration against ar on held-out prompts, interleaved and rotated.

    With `baseline` (the shipped file, when `target_path` is a derived format), ar on it runs
    beside them and every ratio and agreement is to it, so a format's speed and loss show up.
    """
    slim = next((c.slim for c in best.values() if c.slim), None)  # one slim for all modes (see tune)
    engine = Engine(target_path, draft_path, slim_layers=slim, load=load)
    base = Engine(baseline, load=load) if baseline else None
    runners = {m: (engine, m, best[m].spec) for m in best}
    if base:
        runners[BASE] = (base, "ar", SpecParams())
    ref = BASE if base else "ar"
    methods = list(runners)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        for m in best:
            engine.prepare(m)
        log(f"verifying {', '.join(methods)} on {len(prompts)} held-out prompts x {cfg.verify_tokens} tokens")
        for i, p in enumerate(prompts):
            tokens = engine.tokens_for(p.text, True)
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                e, mode, spec = runners[m]
                e.reset()
                res = e.generate(tokens, mode=mode, max_tokens=cfg.verify_tokens, spec=spec)
                runs[m].append({"prompt": p.id, "tokens": res.tokens, "tok_s": res.stats.tokens_per_second})
    finally:
        engine.close()
        if base:
            base.close()
    out = {}
    ar = {r["prompt"]: r for r in runs[ref]}
    for m in methods:
        if not runs[m]:
            continue
        ratios = [r["tok_s"] / ar[r["prompt"]]["tok_s"] for r in runs[m]]
        agree = [fidelity(ar[r["prompt"]]["tokens"], r["tokens"])["agreement"] for r in runs[m]]
        c = best.get(m)
        out[m] = {"label": c.label() if c else "ar on the shipped file", "predicted_speedup": c.speedup if c else 1.0,
                  "measured_speedup": geomean(ratios), "speedup_spread": [min(ratios), max(ratios)],
                  "measured_agreement": float(np.mean(agree)), "predicted_fidelity": c.fidelity if c else 1.0,
                  "tok_s": float(np.median([r["tok_s"] for r in runs[m]]))}
        out[m]["prediction_error"] = out[m]["measured_speedup"] / out[m]["predicted_speedup"] - 1
        log(f"  {m:6s} predicted {out[m]['predicted_speedup']:.2f}x, measured {out[m]['measured_speedup']:.2f}x "
            f"(agreement {out[m]['measured_agreement']:.2f})")
    return out


def _final_choice(chosen: Candidate, best: dict[str, Candidate], checks: dict, floor: float, baseline: Candidate
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


def _copy_drafting_over_ar(final: Candidate, why: str, best: dict[str, Candidate], checks: dict, fmt: str
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


def _finalists(ranked, n: int = 2):
    """The best slims, plus the best prefix (it can import the target's prompt KV)."""
    out = list(ranked[:n])
    prefix = next((s for s in ranked if is_prefix(s.layers)), None)
    if prefix is not None and prefix not in out:
        out.append(prefix)
    return out


def _agreement(traces, sts) -> float:
    return float(np.mean(np.concatenate([s.top == t.target for t, s in zip(traces, sts)])))


def _routing(traces, sts, tau_accept: float = SpecParams().tau_accept, tau_full: float = SpecParams().tau_full) -> dict:
    """How well the slim's score r routes at the default thresholds: tier A keeps the draft token
    (precision: it is the target's), tier B takes the slim's own token (precision likewise)."""
    r = np.concatenate([s.ratio for s in sts])
    draft_ok = np.concatenate([t.draft == t.target for t in traces])
    slim_ok = np.concatenate([s.top == t.target for t, s in zip(traces, sts)])
    a, b = r >= tau_accept, (r >= tau_full) & (r < tau_accept)
    return {"tier_a_share": float(a.mean()), "tier_a_precision": float(draft_ok[a].mean()) if a.any() else float("nan"),
            "tier_b_share": float(b.mean()), "tier_b_precision": float(slim_ok[b].mean()) if b.any() else float("nan")}


def _ms(profile: prof.CostProfile, model: str, n: int) -> str:
    return f"{profile.cost(model, n, profile.contexts[1]) * 1e3:.0f}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
