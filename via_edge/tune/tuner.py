"""`via-edge tune`: measure this machine, search the slim, predict every configuration offline,
check the prediction with a real run, and store the choice the engine then uses by default.

    formats   -> weight-format variants of target and draft: cost at 1..16 tokens, quality
                 against the shipped file; the draft's fastest passing format is used from here on
    profile   -> CostProfile (decode cost of draft, slims, target by batch and context)
    record    -> traces: the target's greedy output on calibration prompts, the draft along it
    search    -> slim layers (agreement with the target along the traces, under a block budget); the
                 slim modes dropped when even their best is predicted slower than ar on its prompts
    predict   -> replay ~800 configurations on the shipped file and each passing format (a format's
                 costs are the shipped profile times its measured cost ratio per batch size)
    choose    -> fastest (format, mode, knobs) meeting both floors, or ar on the shipped file
    verify    -> real interleaved run on held-out prompts: predicted vs measured speedup, for every
                 mode whose result can change the choice
"""

from __future__ import annotations

import datetime as _dt
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..decode import attention, costs
from ..decode.spec import SpecParams
from ..errors import InvalidParameterError, ViaEdgeError
from ..files import write_json
from ..llama import LlamaModel, LoadParams, default_threads
from ..machine import machine, machine_key, versions
from ..prompts import chat_tokens
from ..weights import catalog, formats
from ..weights.derived import derived_files, in_use, remove
from ..weights.gguf_info import read_info
from ..weights.slim import build_slim, format_layers, is_prefix
from .choose import (
    PREDICTED_MARGIN,
    SCREEN_FLOOR,
    Candidate,
    best_per_mode,
    choose,
    copy_drafting_over_ar,
    final_choice,
    frontier,
    grid,
    predict,
    screened_out,
    slim_bound,
    slim_screen,
    worth_checking,
)
from .record import SlimTrace, Trace, calibration_prompts, capture_names, record, slim_traces
from .check import verify
from .search import Search
from .store import TunedConfig, load_choice, tuned_path
from .survey import FORMAT_TOKENS, QUALITY_FLOOR, FormatRow, check_floor, format_prompts, pick, survey, table


def default_formats() -> tuple[str, ...]:
    """What `tune` tries by default: the shipped file and the automatic format's candidates, which
    first use has derived and measured already (`--formats` widens the search)."""
    from ..weights.autoformat import candidates

    return (formats.SHIPPED, *candidates())


@dataclass
class TuneConfig:
    pair: str | None = None
    fidelity_floor: float = 0.95   # via must keep this predicted agreement with the target's greedy output
    out_length: int = 128          # output length that agreement is predicted for
    calib_tokens: int = 48         # target tokens recorded per calibration prompt
    search_prompts: int = 6        # calibration prompts the slim search scores on (the shortest)
    search_evals: int = 8          # slims the search may build and score (about 20 s each for the 1.5B)
    slim_budget: float = 0.75      # a slim may cost at most this share of the target's verify call
    screen_floor: float = SCREEN_FLOOR  # slim modes predicted below this x ar on the search prompts: dropped
    heldout: int = 4               # held-out prompts for the real check
    verify_tokens: int = 48
    repeats: int = 2               # profile repeats (medians kept)
    contexts: tuple[int, ...] = costs.PROFILE_CONTEXTS
    batches: tuple[int, ...] = costs.PROFILE_BATCHES
    n_ctx: int = 4096
    threads: int | None = None
    formats: tuple[str, ...] = field(default_factory=lambda: default_formats())  # tried (shipped always)
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


@dataclass
class Setup:
    """What every stage works on: the pair's files, how models load, the prompts."""

    name: str
    target_path: Path
    draft_path: Path
    has_draft: bool
    load: LoadParams
    threads: int
    calibration: list           # calibration prompts (bench.suite.Prompt)
    heldout: list               # held-out prompts for the real check
    cal_tokens: list[list[int]]
    format_tokens: list[list[int]]  # the format step's calibration (survey.format_prompts)
    before: set[Path]           # derived files that existed before the run (not removed at the end)


@dataclass
class FormatSurvey:
    rows: dict[str, list[FormatRow]]  # per role, the shipped file first
    skipped: list[str]                # what the step did not do, and why (for the report)
    draft: FormatRow | None           # the draft's fastest passing format, used from here on
    ratios: dict[str, dict[int, float]]  # per passing target format: its cost / the shipped file's, by batch size


@dataclass
class Recorded:
    profile: costs.CostProfile
    traces: list[Trace]
    eog: list[int]
    n_blocks: int
    draft_agreement: float
    seconds: dict[str, float]  # the profile's and the recording's


@dataclass
class SlimSearch:
    budget: int                       # most blocks a slim may keep
    scored: list[dict]                # every slim the search scored
    traces: dict[str, list[SlimTrace]]  # per finalist (layers), its traces on every calibration prompt
    model: dict[str, str]             # per finalist, its cost-profile name ("slim-K")
    finalists: list[dict]
    skipped: list[str]                # why the search did not run, if it did not


@dataclass
class Prediction:
    cands: list[Candidate]            # every configuration on the shipped file
    usable: list[Candidate]           # those with the chosen slim, on every passing format
    baseline: Candidate               # ar on the shipped file
    chosen: Candidate                 # the predicted choice
    best: dict[str, Candidate]        # per mode on the chosen format: what the real run checks
    below: dict[str, Candidate]       # lossy modes with nothing above the floor: their most faithful
    slim_layers: str | None


def tune(cfg: TuneConfig, quiet: bool = False) -> dict:
    """Every stage in turn (the module's docstring); the choice is stored, the report returned."""
    log, t_start, timings = Log(quiet), time.monotonic(), {}

    def timed(stage: str, fn, *args):
        t0 = time.monotonic()
        out = fn(*args)
        timings[stage] = time.monotonic() - t0
        return out

    setup = prepare(cfg)
    fmts = timed("formats", survey_formats, cfg, setup, log)
    rec = profile_and_record(cfg, setup, fmts, log)
    timings.update(rec.seconds)
    slims = timed("search", search_slims, cfg, setup, rec, log)
    pred = timed("predict", predict_all, cfg, rec, slims, fmts, log)
    fmt_path = formats.derive(setup.target_path, pred.chosen.format)
    checked, unchecked = worth_checking(pred.best, pred.below, pred.chosen)
    checks = timed("verify", verify, fmt_path, _draft_path(setup, fmts), checked, setup.heldout, cfg.verify_tokens,
                   setup.load, log, setup.target_path if pred.chosen.format != formats.SHIPPED else None)
    final, why = final_choice(pred.chosen, pred.best, checks, cfg.fidelity_floor, pred.baseline)
    final, why = copy_drafting_over_ar(final, why, pred.best, checks, pred.chosen.format)
    log(why)
    timings["total"] = time.monotonic() - t_start
    return store(cfg, setup, fmts, rec, slims, pred, checks, final, why, timings, log, unchecked)


def prepare(cfg: TuneConfig) -> Setup:
    """Every option checked, the pair's files fetched, the prompts chosen."""
    pair = catalog.pair(cfg.pair)
    name = pair["name"]
    if not 0 < cfg.fidelity_floor <= 1:
        raise InvalidParameterError(f"--fidelity-floor must be in (0, 1], got {cfg.fidelity_floor}")
    if not 0 < cfg.slim_budget < 1:
        raise InvalidParameterError(f"--slim-budget must be in (0, 1), got {cfg.slim_budget}")
    if not cfg.screen_floor >= 0:
        raise InvalidParameterError(f"--screen-floor must be 0 or more, got {cfg.screen_floor}")
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
    if read_info(target_path).block_count < 2:
        raise InvalidParameterError(f"{target_path.name} has fewer than 2 blocks: there is no slim to search")
    cal = calibration_prompts(1)
    spare = calibration_prompts(1, skip=1)
    held = spare[:: max(1, len(spare) // cfg.heldout)][: cfg.heldout]  # spread over the categories
    with LlamaModel(target_path, load) as target:
        cal_tokens = [chat_tokens(target, [{"role": "user", "content": p.text}]) for p in cal]
        fmt_tokens = format_prompts(target)
    return Setup(name, target_path, draft_path, bool(pair.get("draft")), load, threads, cal, held, cal_tokens,
                 fmt_tokens, before)


def survey_formats(cfg: TuneConfig, setup: Setup, log: Log) -> FormatSurvey:
    """Weight-format variants of target and draft: their cost and quality against the shipped file."""
    sources = {"target": setup.target_path, **({"draft": setup.draft_path} if setup.has_draft else {})}
    rows: dict[str, list[FormatRow]] = {}
    reused: list[str] = []
    wider = [f for f in formats.default_formats() if f not in cfg.formats]
    skipped = [f"formats {', '.join(wider)} not tried: each takes minutes to derive on a small machine and the "
               "automatic format's candidates cover this build's fast kernels (`--formats` adds them)"] if wider else []
    if set(cfg.formats) - {formats.SHIPPED}:
        log(f"formats {', '.join(cfg.formats)} of {', '.join(sources)}: deriving (cached), quality, costs")
        # the format step's calibration: quality the automatic format measured is read from its cache
        rows = survey(sources, cfg.formats, setup.format_tokens, setup.load, continuation=FORMAT_TOKENS, log=log,
                      reused=reused)
        if reused:
            skipped.append(f"quality of {', '.join(reused)} not measured again: read from the format step's cache")
        for role, rs in rows.items():
            log(f"  {role}: " + "; ".join(f"{r.format} {r.cost[1] * 1e3:.0f} ms/token"
                                         + (f", agreement {r.quality.agreement:.3f}" if r.quality else "")
                                         for r in rs))
    draft = pick(rows["draft"], cfg.quality_floor) if "draft" in rows else None
    shipped = rows["target"][0] if rows else None
    ratios = {r.format: {n: r.cost[n] / shipped.cost[n] for n in r.cost}
              for r in rows.get("target", [])[1:] if r.clears(cfg.quality_floor)}
    return FormatSurvey(rows, skipped, draft, ratios)


def _draft_path(setup: Setup, fmts: FormatSurvey) -> Path:
    return fmts.draft.path if fmts.draft is not None else setup.draft_path


def profile_and_record(cfg: TuneConfig, setup: Setup, fmts: FormatSurvey, log: Log) -> Recorded:
    """The cost profile of draft, target and two prefix slims; the target's greedy output on the
    calibration prompts, and the draft along it."""
    t0 = time.monotonic()
    # as an engine opens it (flash attention as measured, draft and slims alike): what the modes run
    target, load = attention.open_measured(setup.target_path, setup.load, lambda p: LlamaModel(setup.target_path, p))
    with target, LlamaModel(_draft_path(setup, fmts), load) as draft:
        n_blocks = target.n_layer
        eog = [t for t in range(target.n_vocab) if target.is_eog(t)]
        sizes = sorted({max(1, round(n_blocks * f)) for f in (0.4, 0.7)} - {n_blocks})  # + target: 3 points
        slim_files = {f"slim-{k}": build_slim(setup.target_path, f"0-{k - 1}") for k in sizes}
        models = {"target": target, "draft": draft}
        opened = {key: LlamaModel(path, load) for key, path in slim_files.items()}
        try:
            models.update(opened)
            fill = [t for p in setup.cal_tokens for t in p]
            log(f"profiling {', '.join(models)}: batches {', '.join(map(str, cfg.batches))}, contexts "
                f"{', '.join(map(str, cfg.contexts))}, {cfg.repeats} repeats")
            profile = costs.measure(models, fill, batches=cfg.batches, contexts=cfg.contexts, repeats=cfg.repeats)
        finally:
            for m in opened.values():
                m.close()
        profile.meta = {"pair": setup.name, "machine": machine_key(), "cpu": machine()["cpu"], "threads": setup.threads,
                        "date": _now(), "load": {k: v for k, v in asdict(load).items() if k != "capture"},
                        "fit_error": profile.fit_error()}
        write_json(tuned_path(setup.name, "profile"), profile.to_dict())
        log(f"profile: target {_ms(profile, 'target', 1)} ms/token alone, {_ms(profile, 'target', 8)} ms for 8; "
            f"draft {_ms(profile, 'draft', 1)} ms; slim cost by block count within "
            f"{profile.meta['fit_error']['median']:.0%} (median; worst point {profile.meta['fit_error']['max']:.0%})")
        t1 = time.monotonic()
        traces = record(target, draft, setup.cal_tokens, cfg.calib_tokens)
    t2 = time.monotonic()
    agree = float(np.mean(np.concatenate([t.draft == t.target for t in traces])))
    log(f"recorded {len(traces)} calibration prompts x {cfg.calib_tokens} tokens; draft agrees with the "
        f"target on {agree:.2f} of them")
    return Recorded(profile, traces, eog, n_blocks, agree, {"profile": t1 - t0, "record": t2 - t1})


def search_slims(cfg: TuneConfig, setup: Setup, rec: Recorded, log: Log) -> SlimSearch:
    """Slim layer sets within the cost budget, scored by agreement along the traces; the best
    (and the best prefix) scored again on every calibration prompt."""
    profile, traces, n_blocks, load = rec.profile, rec.traces, rec.n_blocks, setup.load
    verify_calls = profile.cost("target", SpecParams().n_draft + 1, cfg.contexts[1])
    budget = max((k for k in range(1, n_blocks)
                  if profile.slim_cost(k, SpecParams().n_draft + 1, cfg.contexts[1]) <= cfg.slim_budget * verify_calls),
                 default=1)  # even one block over budget: search the cheapest slims anyway, the replay decides
    bound = slim_bound(profile, cfg.contexts[1])
    if bound < cfg.screen_floor * (1.0 + PREDICTED_MARGIN):  # a screen like the one below: 0 keeps the slims
        why = (f"slim search skipped: even if every draft token were kept and only the cheapest slim checked "
               f"them, via would run at most {bound:.2f}x ar here, below the +{PREDICTED_MARGIN:.0%} margin")
        log(why)
        return SlimSearch(budget, [], {}, {}, [], [why])
    order = sorted(range(len(traces)), key=lambda i: len(traces[i].prompt))
    search_set = [traces[i] for i in order[: cfg.search_prompts]]
    scratch = Path(tempfile.mkdtemp(prefix="via-edge-search-", dir=catalog.model_dir()))
    seen: dict[tuple[int, ...], list[SlimTrace]] = {}  # each scored slim's traces on the search prompts
    try:
        def evaluate(layers, want_influence):
            path = build_slim(setup.target_path, format_layers(layers), scratch / f"{format_layers(layers)}.gguf")
            extra_load = replace(load, capture=capture_names(len(layers)) if want_influence else ())
            with LlamaModel(path, extra_load) as slim:
                sts, infl = slim_traces(slim, search_set, hidden=want_influence)
            path.unlink()
            seen[layers] = sts
            return _agreement(search_set, sts), _routing(search_set, sts), infl

        log(f"searching slims of at most {budget} of {n_blocks} blocks (slim cost <= {cfg.slim_budget:.0%} of the "
            f"target's verify call), {cfg.search_evals} evaluations on {len(search_set)} prompts")
        search = Search(n_blocks, budget, evaluate, max_evals=cfg.search_evals, log=log)
        ranked = search.run()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    scored = [{"layers": format_layers(s.layers), "blocks": len(s.layers), "strategy": s.strategy,
               "agreement": s.agreement, **s.extra} for s in search.scored.values()]
    finalists = _finalists(ranked)
    names = {format_layers(s.layers): f"slim-{len(s.layers)}" for s in finalists}
    screen = slim_screen(search_set, {format_layers(s.layers): seen[s.layers] for s in finalists}, names,
                         profile.cost, rec.eog, cfg.out_length, cfg.fidelity_floor)
    why = screened_out(screen, len(search_set), cfg.screen_floor)
    if why:
        log(why)
        return SlimSearch(budget, scored, {}, {}, [], [why])
    data, model, scores = {}, {}, []
    for s in finalists:
        layers = format_layers(s.layers)
        with LlamaModel(build_slim(setup.target_path, layers), load) as slim:
            data[layers], _ = slim_traces(slim, traces)
        model[layers] = f"slim-{len(s.layers)}"
        scores.append({"layers": layers, "blocks": len(s.layers), "strategy": s.strategy,
                       "search_agreement": s.agreement, "agreement": _agreement(traces, data[layers]),
                       **_routing(traces, data[layers])})
    log("finalists: " + "; ".join(f"{d['layers']} agreement {d['agreement']:.2f}" for d in scores))
    return SlimSearch(budget, scored, data, model, scores, [])


def predict_all(cfg: TuneConfig, rec: Recorded, slims: SlimSearch, fmts: FormatSurvey, log: Log) -> Prediction:
    """Replay every configuration on the shipped file, then every mode on each passing format
    with the chosen slim; the predicted choice and what the real run checks."""
    t0 = time.monotonic()
    traces, cost, eog = rec.traces, rec.profile.cost, rec.eog
    cands = predict(traces, slims.traces, slims.model, cost, eog, cfg.out_length, grid(list(slims.traces)))
    best = best_per_mode(cands, cfg.fidelity_floor)
    # the engine loads one slim: the one of the faster slim mode; the other mode is tuned for it too
    slim_modes = [best[m] for m in ("via", "hier") if m in best]
    slim_layers = max(slim_modes, key=lambda c: c.speedup).slim if slim_modes else None
    usable = [c for c in cands if c.slim in (None, slim_layers)]
    for fmt, ratio in fmts.ratios.items():
        usable += predict(traces, slims.traces, slims.model, rec.profile.scaled(ratio), eog, cfg.out_length,
                          grid([slim_layers] if slim_layers else []), fmt=fmt, baseline=cost)
    baseline = next(c for c in cands if c.mode == "ar")
    chosen = choose(best_per_mode(usable, cfg.fidelity_floor), baseline)
    log(f"predicted {len(usable)} configurations in {time.monotonic() - t0:.0f}s; best per mode: "
        + ", ".join(f"{c.label()} {c.speedup:.2f}x" for c in best_per_mode(usable, cfg.fidelity_floor).values()))
    fmt = chosen.format  # the real check runs every mode on it, against ar on the shipped file
    best = best_per_mode(usable, cfg.fidelity_floor, fmt=fmt)
    below = {m: max((c for c in usable if c.mode == m and c.format == fmt), key=lambda c: (c.fidelity, c.speedup))
             for m in ("via",) if m not in best and any(c.mode == m and c.format == fmt for c in usable)}
    return Prediction(cands, usable, baseline, chosen, best, below, slim_layers)


def store(cfg: TuneConfig, setup: Setup, fmts: FormatSurvey, rec: Recorded, slims: SlimSearch, pred: Prediction,
          checks: dict, final: Candidate, why: str, timings: dict, log: Log, unchecked: list[str]) -> dict:
    """The choice written where the engine reads it, files this run made and did not choose
    removed, and the whole report returned."""
    name, best, below = setup.name, pred.best, pred.below
    if final.format != pred.chosen.format:  # fell back to ar on the shipped file: keep the shipped format's knobs
        best, below = best_per_mode(pred.usable, cfg.fidelity_floor, fmt=final.format), {}
    modes = {m: asdict(c.spec) for m, c in {**best, **below}.items()}
    choice = TunedConfig(name, final.mode, pred.slim_layers, modes, why, target_format=final.format,
                         draft_format=fmts.draft.format if fmts.draft else formats.SHIPPED,
                         formats=sorted(set(cfg.formats) | {formats.SHIPPED}))
    derived_cands = [c for c in pred.usable if c.format != formats.SHIPPED]
    result = {
        "meta": {"date": _now(), "pair": name, "machine": {**machine(), "threads_used": setup.threads,
                                                            "key": machine_key()},
                 "versions": versions(), "config": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in asdict(cfg).items()},
                 "calibration": [p.id for p in setup.calibration], "heldout": [p.id for p in setup.heldout],
                 "timings": timings, "skipped": fmts.skipped + slims.skipped + unchecked,
                 "draft_agreement": rec.draft_agreement, "block_budget": slims.budget,
                 "n_blocks": rec.n_blocks},
        "formats": {role: [r.to_dict() for r in rows] for role, rows in fmts.rows.items()},
        "formats_table": table(fmts.rows, cfg.quality_floor) if fmts.rows else "",
        "profile": rec.profile.to_dict(),
        "search": slims.scored,
        "finalists": slims.finalists,
        "candidates": [c.to_dict() for c in pred.cands + derived_cands],
        "frontier": [c.label() for c in frontier(pred.cands + derived_cands)],
        "best": {m: c.to_dict() for m, c in best.items()},
        "below_floor": {m: c.to_dict() for m, c in below.items()},
        "predicted_choice": pred.chosen.to_dict(),
        "verify": checks,
        "choice": choice.to_dict(),
    }
    write_json(tuned_path(name, "choice"), choice.to_dict())
    result["paths"] = {"profile": str(tuned_path(name, "profile")), "choice": str(tuned_path(name, "choice"))}
    made = derived_files()
    used = in_use(made)
    dropped = [d for d in made if d.path not in setup.before and d.path not in used]
    freed = sum(remove(d.path) for d in dropped)
    if dropped:
        log(f"removed {len(dropped)} files this run made and did not choose ({freed / 1e9:.1f} GB): "
            + ", ".join(d.kind for d in dropped))
    result["removed"] = [str(d.path) for d in dropped]
    return result


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


def _ms(profile: costs.CostProfile, model: str, n: int) -> str:
    return f"{profile.cost(model, n, profile.contexts[1]) * 1e3:.0f}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
