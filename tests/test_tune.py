"""via-edge tune: the replay is the decoding loop, the search finds a planted slim, the never-slower
rule holds, and a tuned choice becomes the default of the engine and the command line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import EXACT, make_tiny_gguf

from via_edge import Engine, SpecParams
from via_edge.decode.costs import CostProfile, measure
from via_edge.decode.copying import CopyDrafter, CopyPolicy
from via_edge.decode.scores import LogitRows
from via_edge.llama import LlamaModel, LoadParams
from via_edge.tune.choose import best_per_mode, choose, frontier, grid, predict
from via_edge.tune.record import SlimTrace, Trace, capture_names, record, slim_traces
from via_edge.tune.replay import MeteredKV, predicted_agreement, replay
from via_edge.tune.search import Search
from via_edge.weights.slim import build_slim, format_layers

PROMPTS = ["hello world", "the cat is here", "some more words in here", "xyz 123 abc"]
ONE_PER_CALL = lambda model, n, ctx: 1.0  # noqa: E731  (seconds == calls)

CASES = [
    ("ar", SpecParams()),
    ("sd", SpecParams(n_draft=1)),
    ("sd", SpecParams(n_draft=4)),
    ("sd", SpecParams(n_draft=8)),
    ("lookup", SpecParams(n_draft=3)),
    ("hier", SpecParams(n_draft=3, tau_full=0.3, hier_block=8)),
    ("hier", SpecParams(n_draft=2, tau_full=0.6, hier_block=4)),
    ("via", SpecParams(n_draft=4)),
    ("via", SpecParams(n_draft=3, tau_accept=0.99, tau_full=0.05)),
    ("via", SpecParams(n_draft=6, tau_accept=0.6, tau_full=0.2, max_lag=4)),
]


@pytest.fixture(scope="module")
def recorded(tiny_dir):
    """Two tiny targets with a 2-block draft and a 3-block slim, recorded along their greedy output."""
    out = []
    for seed in (1, 7):
        engine = Engine(make_tiny_gguf(tiny_dir / f"tune{seed}.gguf", blocks=4, seed=seed), draft_layers="0-1",
                        slim_layers="0-2", **EXACT)
        for mode in ("sd", "via"):
            engine.prepare(mode)
        toks = [engine.tokens_for(p, False) for p in PROMPTS]
        traces = record(engine.target, engine.models.draft, toks, 40)
        sts, _ = slim_traces(engine.models.slim, traces)
        eog = [t for t in range(engine.target.n_vocab) if engine.target.is_eog(t)]
        out.append((engine, toks, traces, sts, eog))
    yield out
    for engine, *_ in out:
        engine.close()


def test_replay_reproduces_real_greedy_runs(recorded):
    """Tokens, origins, tiers and rounds as the real loop commits them (via: up to and including
    its first token that differs from the target's); drafted tokens and model calls per model
    wherever the records determine them (no error, no stand-in score)."""
    via_tiers, via_errors, exact_costs = set(), 0, set()
    for engine, toks, traces, sts, eog in recorded:
        for mode, spec in CASES:
            engine.prepare(mode)
            for tok, tr, st in zip(toks, traces, sts):
                engine.reset()  # a fresh copy drafter, as the replay's
                lookup = CopyDrafter(CopyPolicy(engine.models.batch_cost)) if mode == "lookup" else None
                real = engine.generate(tok, mode=mode, max_tokens=len(tr.target), spec=spec)
                rp = replay(tr, st, mode, spec, ONE_PER_CALL, eog, lookup=lookup)
                n = rp.first_error + 1 if rp.first_error >= 0 else len(rp.tokens)
                where = f"{mode} {spec} prompt {tok[:4]}"
                assert real.tokens[:n] == rp.tokens[:n], where
                assert real.origins[:n] == rp.origins[:n], where
                assert real.tiers[:n] == rp.tiers[:n], where
                if mode != "via":
                    assert rp.first_error == -1 and real.tokens == list(tr.target), where
                s = real.stats
                if rp.first_error < 0:
                    assert rp.rounds == s.rounds, where
                if rp.first_error < 0 and rp.guesses == 0:
                    exact_costs.add(mode)
                    prefill = int(len(tok) > 1)  # the prompt's one call (the draft's); a prefix slim imports KV
                    assert rp.draft_n == s.draft_n, where
                    assert rp.calls["target"] == s.target.calls - 1, where  # the prompt's call (Seq.prime)
                    if mode in ("sd", "via", "hier"):
                        assert rp.calls["draft"] == s.draft.calls - prefill, where
                    if mode in ("via", "hier"):
                        assert rp.calls["slim"] == s.slim.calls, where
                if mode == "via":
                    via_tiers |= set(real.tiers[:n])
                    via_errors += rp.first_error >= 0
    assert via_tiers == {"A", "B", "C"}  # the comparison covered every tier
    assert via_errors > 0                # and the first-error path
    assert exact_costs == {"ar", "sd", "lookup", "hier", "via"}  # and the costs of every mode


def test_replay_prices_what_it_decodes(recorded):
    """Seconds are the sum of the cost of each call's batch: ar pays one token per call, and the
    first answer token's row comes with the prompt (Seq.prime), so its round is free."""
    engine, toks, traces, sts, eog = recorded[0]
    seen = []
    cost = lambda m, n, c: seen.append((m, n, c)) or 0.5 * n  # noqa: E731
    rp = replay(traces[0], None, "ar", SpecParams(), cost, eog)
    assert all(m == "target" and n == 1 for m, n, _ in seen)
    assert [c for *_, c in seen] == list(range(len(toks[0]), len(toks[0]) - 1 + len(traces[0].target)))
    assert rp.seconds == pytest.approx(0.5 * (len(traces[0].target) - 1))


def test_search_finds_planted_layers(tiny_dir):
    """Blocks 1 and 4 carry the model, the others barely touch it: the best 2-block slim is 1,4,
    and it is neither a prefix nor a first-and-last window, so the search must find it."""
    scales = [0.02, 1.5, 0.02, 0.02, 1.5, 0.02]
    path = make_tiny_gguf(tiny_dir / "planted.gguf", blocks=6, seed=5, block_scales=scales)
    load = LoadParams(**EXACT)
    with LlamaModel(path, load) as target:
        traces = record(target, None, [target.tokenize(p, add_special=False) for p in PROMPTS], 24)
    calls = []

    def evaluate(layers, want_influence):
        calls.append(layers)
        out = build_slim(path, format_layers(layers), tiny_dir / f"planted-{format_layers(layers)}.gguf")
        with LlamaModel(out, replace(load, capture=capture_names(len(layers)) if want_influence else ())) as slim:
            sts, infl = slim_traces(slim, traces, hidden=want_influence)
        agree = float(np.mean(np.concatenate([s.top == t.target for s, t in zip(sts, traces)])))
        return agree, {}, infl

    ranked = Search(6, 2, evaluate, max_evals=30).run()
    assert ranked[0].layers == (1, 4)
    assert ranked[0].agreement >= 0.9 > max(s.agreement for s in ranked[1:])
    assert len(calls) == len(set(calls)) <= 30  # memoised, within the evaluation budget
    assert all(len(s.layers) <= 2 for s in ranked)


def test_search_skips_greedy_removal_it_cannot_finish():
    """Removing 8 of 10 blocks one at a time takes 9 evaluations: with 5 in all, the whole target
    and the steps toward the budget would be spent on slims that can never fit it, so every
    evaluation goes to slims within the budget; with enough of them greedy removal runs."""
    def evaluate(layers, want_influence):
        calls.append(layers)
        return len(set(layers) & {3, 7}) / 2, {}, np.arange(len(layers), dtype=float) if want_influence else None

    calls = []
    ranked = Search(10, 2, evaluate, max_evals=5).run()
    assert len(calls) == 5 and all(len(c) <= 2 for c in calls)
    assert all(len(s.layers) <= 2 for s in ranked)
    calls = []
    Search(10, 2, evaluate, max_evals=12).run()
    assert tuple(range(10)) in calls  # the whole target, greedy removal's start


def synthetic_traces(draft_agree: float, n: int = 4, length: int = 48):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        target = rng.integers(10, 1000, length)
        draft = np.where(rng.random(length) < draft_agree, target, target + 1)
        out.append(Trace(list(range(1, 20)), target, draft, np.full(length, 0.8)))
    return out


def linear_cost(draft_per_call: float):
    """A target call costs 1 + 0.1 per extra token; a slim of K blocks K/4 of that (4-block target)."""
    def cost(model, n, ctx):
        if model == "draft":
            return draft_per_call
        scale = int(model[5:]) / 4 if model.startswith("slim-") else 1.0
        return scale * (1.0 + 0.1 * (n - 1))
    return cost


@pytest.mark.parametrize("draft_cost,expect_ar", [(2.0, True), (0.05, False)])
def test_never_slower_rule(draft_cost, expect_ar):
    """With an expensive draft nothing speculative is predicted faster, and the choice is ar; the same
    traces with a cheap draft do pay, so the rule is not simply always choosing ar."""
    traces = synthetic_traces(0.9)
    slims = {"0-1": [SlimTrace(t.target.copy(), np.where(t.draft == t.target, 1.0, 0.1)) for t in traces]}
    cands = predict(traces, slims, {"0-1": "slim-2"}, linear_cost(draft_cost), eog=[], out_length=128,
                    configs=grid(["0-1"]))
    best = best_per_mode(cands, 0.95)
    chosen = choose(best, best["ar"])
    assert (chosen.mode == "ar") == expect_ar
    if expect_ar:  # lookup finds no copy in random text and abstains every round: exactly ar's cost
        assert all(c.speedup < 1.0 for m, c in best.items() if m not in ("ar", "lookup"))
        assert best["lookup"].speedup == pytest.approx(1.0)
    else:
        assert chosen.speedup > 1.3 and chosen.fidelity >= 0.95
    front = frontier(cands)
    assert all(a.speedup < b.speedup and a.fidelity >= b.fidelity for a, b in zip(front, front[1:]))


@pytest.mark.parametrize("draft_cost,pays", [(2.0, False), (0.05, True)])
def test_slim_screen_finds_whether_slim_modes_can_pay(draft_cost, pays):
    """The screen is the best slim configuration of the full replay on the same traces: below ar
    with an expensive draft (the finalists are then not scored), above it with a cheap one."""
    from via_edge.tune.choose import SCREEN_FLOOR, screened_out, slim_screen

    traces = synthetic_traces(0.9)
    slims = {"0-1": [SlimTrace(t.target.copy(), np.where(t.draft == t.target, 1.0, 0.1)) for t in traces]}
    screen = slim_screen(traces, slims, {"0-1": "slim-2"}, linear_cost(draft_cost), eog=[], out_length=128, floor=0.95)
    best = best_per_mode(predict(traces, slims, {"0-1": "slim-2"}, linear_cost(draft_cost), eog=[], out_length=128,
                                 configs=grid(["0-1"])), 0.95)
    assert screen.mode in ("via", "hier") and screen.speedup == max(best["via"].speedup, best["hier"].speedup)
    assert (screen.speedup >= SCREEN_FLOOR) == pays
    why = screened_out(screen, len(traces))
    assert (why is None) == pays
    if not pays:
        assert f"{screen.speedup:.2f}x ar" in why and screened_out(screen, len(traces), floor=0.0) is None


def test_checks_left_out_cannot_change_the_choice():
    """Whatever the held-out runs measure, the choice made from the checked modes alone is the one
    made from every mode's check: the modes left out could not have been chosen."""
    from via_edge.tune.choose import Candidate, copy_drafting_over_ar, final_choice, worth_checking

    rng = np.random.default_rng(3)
    base, dropped = Candidate("ar", SpecParams()), 0
    for _ in range(300):
        best = {"ar": Candidate("ar", SpecParams(), speedup=float(rng.choice([1.0, 1.3])),
                                format=str(rng.choice(["shipped", "q4_0"])))}
        for m in ("lookup", "sd", "hier", "via"):
            best[m] = Candidate(m, SpecParams(), speedup=float(rng.uniform(0.5, 1.6)), format=best["ar"].format)
        below = {"via": best.pop("via")} if rng.random() < 0.3 else {}
        chosen = choose(best, base)
        checks = {m: {"measured_speedup": float(rng.uniform(0.7, 1.7)), "measured_agreement": float(rng.uniform(0.9, 1))}
                  for m in list(best) + list(below)}
        keep, why = worth_checking(best, below, chosen)
        assert {"ar", "lookup", chosen.mode} <= set(keep)
        assert len(why) == len(best) + len(below) - len(keep)
        dropped += len(why)

        def decide(c):
            final, text = final_choice(chosen, best, c, 0.95, base)
            return copy_drafting_over_ar(final, text, best, c, chosen.format)[0]
        assert decide({m: checks[m] for m in keep}) is decide(checks)
    assert dropped > 100  # the draws did leave modes out


def test_final_choice_needs_both_margins():
    """A mode measured fast on a few held-out prompts but predicted below the margin stays out."""
    from via_edge.tune.choose import Candidate, final_choice

    best = {"ar": Candidate("ar", SpecParams()), "lookup": Candidate("lookup", SpecParams(n_draft=3), speedup=1.04),
            "sd": Candidate("sd", SpecParams(n_draft=3), speedup=1.20)}
    checks = {m: {"measured_speedup": v, "measured_agreement": 1.0} for m, v in
              (("ar", 1.0), ("lookup", 1.11), ("sd", 1.02))}
    final, why = final_choice(choose(best, best["ar"]), best, checks, 0.95, best["ar"])
    assert final.mode == "ar" and "chose ar" in why  # sd measured too slow, lookup predicted too slow
    checks["sd"]["measured_speedup"] = 1.08
    assert final_choice(choose(best, best["ar"]), best, checks, 0.95, best["ar"])[0].mode == "sd"


def format_rows(agreements: dict[str, float], n1_ms: dict[str, float]):
    """Synthetic survey rows: the shipped file plus variants with given quality and n=1 cost."""
    from via_edge.tune.survey import FormatRow
    from via_edge.weights.quality import Quality

    rows = [FormatRow("target", "shipped", Path("s.gguf"), 1, {1: n1_ms["shipped"] / 1e3, 8: 0.3})]
    for f, a in agreements.items():
        rows.append(FormatRow("target", f, Path(f"{f}.gguf"), 1, {1: n1_ms[f] / 1e3, 8: 0.2},
                              Quality(a, 0.1, 10.0, 9.0, 500)))
    return rows


def test_format_is_picked_only_when_it_clears_the_quality_floor():
    """The fastest format wins only above the floor; below it the next fastest passing one, and the
    shipped file when none passes (a floor of 0 admits everything, 1 only the shipped file)."""
    from via_edge.tune.survey import pick

    rows = format_rows({"q4_0": 0.88, "iq4_nl": 0.93, "q4_k": 0.97}, {"shipped": 50, "q4_0": 33, "iq4_nl": 42, "q4_k": 47})
    assert pick(rows, 0.90).format == "iq4_nl"
    assert pick(rows, 0.85).format == "q4_0"
    assert pick(rows, 0.95).format == "q4_k"
    assert pick(rows, 1.0).format == "shipped"
    assert pick(rows, 0.0).format == "q4_0"


def test_tune_choice_across_formats_needs_quality_and_margins():
    """A faster format's plain decoding is a legitimate choice, priced against ar on the shipped
    file; a format whose costs do not clear the margin leaves ar on the shipped file."""
    from via_edge.decode.costs import CostProfile
    from via_edge.tune.choose import Candidate, final_choice

    base = Candidate("ar", SpecParams())
    traces = synthetic_traces(0.9)
    prof = CostProfile([1, 2, 4, 8, 16], [64, 1024], {"target": [[1.0, 1.1, 1.3, 1.7, 2.5]] * 2,
                                                      "draft": [[0.5] * 5] * 2}, {"target": 4, "draft": 2})
    for ratio, chosen_fmt in ((0.66, "q4_0"), (0.95, "shipped")):
        cands = [base] + predict(traces, {}, {}, prof.scaled({1: ratio, 16: ratio}), eog=[], out_length=128,
                                 configs=[("ar", SpecParams(), None)], fmt="q4_0", baseline=prof.cost)
        assert cands[1].speedup == pytest.approx(1 / ratio)
        chosen = choose(best_per_mode(cands, 0.95), base)
        assert chosen.format == chosen_fmt
    # the real run must agree: the q4_0 ar measured only 3% faster falls back to the shipped file
    best = {"ar": Candidate("ar", SpecParams(), speedup=1.5, format="q4_0")}
    assert final_choice(best["ar"], best, {"ar": {"measured_speedup": 1.48, "measured_agreement": 0.9}},
                         0.95, base)[0].format == "q4_0"
    final, why = final_choice(best["ar"], best, {"ar": {"measured_speedup": 1.03, "measured_agreement": 0.9}},
                               0.95, base)
    assert final is base and "chose ar" in why


def test_profile_reads_are_bilinear_at_every_point_asked():
    """Reads are remembered (the replay asks the same points hundreds of thousands of times):
    each (model, n, ctx) must still get its own value, within and beyond the measured grid."""
    from via_edge.decode.costs import CostProfile

    prof = CostProfile([1, 4], [100, 300], {"target": [[1.0, 4.0], [3.0, 12.0]], "draft": [[0.5, 0.5], [0.5, 0.5]]},
                       {"target": 4, "draft": 2})
    points = [("target", 1, 100, 1.0), ("target", 1, 200, 2.0), ("target", 4, 200, 8.0), ("target", 2, 100, 2.0),
              ("target", 2, 300, 6.0), ("target", 8, 100, 8.0), ("target", 1, 500, 5.0), ("draft", 1, 200, 0.5)]
    for _ in range(2):
        for model, n, ctx, want in points:
            assert prof.cost(model, n, ctx) == pytest.approx(want), (model, n, ctx)
    fast = prof.scaled({1: 0.5, 4: 0.25})  # the draft keeps its own costs
    for model, n, ctx, want in points * 2:
        ratio = 1.0 if model == "draft" else float(np.interp(n, [1, 4], [0.5, 0.25]))
        assert fast(model, n, ctx) == pytest.approx(want * ratio), (model, n, ctx)


def test_predicted_agreement():
    assert predicted_agreement(0.0, 128) == 1.0
    assert predicted_agreement(0.5, 2) == pytest.approx((0.5 + 0.25) / 2)
    rng = np.random.default_rng(1)  # against simulation: share of 64 tokens before the first error
    sims = [min(int(rng.geometric(0.02)) - 1, 64) / 64 for _ in range(20000)]
    assert predicted_agreement(0.02, 64) == pytest.approx(np.mean(sims), abs=0.01)


def test_profile_measures_and_interpolates(tiny_target, tiny_dir):
    load = LoadParams(**EXACT)
    paths = {"slim-1": build_slim(tiny_target, "0"), "slim-2": build_slim(tiny_target, "0-1")}
    with LlamaModel(tiny_target, load) as target:
        models = {"target": target, **{k: LlamaModel(p, load) for k, p in paths.items()}}
        fill = target.tokenize("the quick brown fox jumps over the lazy dog " * 8, add_special=False)
        prof = measure(models, fill, batches=(1, 2, 4), contexts=(8, 32), repeats=2)
        decoded = target.seqs[0].usage.tokens
        for k in paths:
            models[k].close()
    # the longest context is filled once (less the 4 tokens of the last batch at context 8, which
    # begin it): the second repeat walks the contexts down, rolling back (filling it again: 76)
    assert decoded == 32 - 4 + 2 * 2 * (1 + 2 + 4)
    assert set(prof.table) == {"target", "slim-1", "slim-2"} and prof.blocks["slim-2"] == 2
    assert all(len(rows) == 2 and all(len(r) == 3 and min(r) > 0 for r in rows) for rows in prof.table.values())
    assert prof.cost("slim-2", 2, 8) == prof.table["slim-2"][0][1]
    assert prof.cost("slim-3", 2, 8) == pytest.approx((prof.table["slim-2"][0][1] + prof.table["target"][0][1]) / 2)
    again = CostProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.cost("target", 3, 20) == pytest.approx(prof.cost("target", 3, 20))
    # a profile linear in blocks interpolates exactly
    lin = CostProfile([1, 2], [8, 16], {f"slim-{k}": [[k * 1.0, k * 2.0]] * 2 for k in (1, 2)} |
                      {"target": [[4.0, 8.0]] * 2}, {"slim-1": 1, "slim-2": 2, "target": 4})
    assert lin.fit_error() == pytest.approx({"median": 0.0, "max": 0.0})
    assert lin.cost("slim-3", 2, 12) == pytest.approx(6.0)


def test_a_steady_one_token_cost_is_timed_after_a_decode_of_its_own(tiny_target):
    """The format step prices plain decoding by one-token decodes that follow one another (the
    first after a switch of model or batch size costs more, section 79): with `steady`, each
    one-token sample decodes one token untimed and `steady` timed, and larger batches as before."""
    load = LoadParams(**EXACT)
    with LlamaModel(tiny_target, load) as target:
        fill = target.tokenize("the quick brown fox jumps over the lazy dog " * 8, add_special=False)
        decoded = []
        measure({"target": target}, fill, batches=(1, 2), contexts=(8,), repeats=1)  # the context filled once
        for steady in (0, 3):
            before = target.seqs[0].usage.tokens
            prof = measure({"target": target}, fill, batches=(1, 2), contexts=(8,), repeats=2, steady=steady)
            decoded.append(target.seqs[0].usage.tokens - before)
            assert min(prof.table["target"][0]) > 0
    assert decoded[1] - decoded[0] == 2 * (1 + 3 - 1)  # per repeat: an untimed token and 3 timed, not 1


def test_profile_runs_the_attention_the_engine_runs(tiny_target, monkeypatch, tmp_path):
    """The tuner profiles and records the target with the flash-attention setting measured for
    its file, as the engine loads it, not llama.cpp's default (on): fails on a profile made with
    the default, whose load says None."""
    from via_edge.decode import attention
    from via_edge.files import write_json
    from via_edge.tune import tuner

    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "MIN_BYTES", 0)  # the tiny file counts as one worth measuring
    load = LoadParams(n_ctx=256, n_threads=2)
    write_json(attention._path(tiny_target, load), {"model": tiny_target.name, "flash_attn": False, "off_gain": 1.2})
    setup = tuner.Setup("tiny", tiny_target, build_slim(tiny_target, "0"), False, load, 2, [], [],
                        [[1, 2, 3, 4, 5, 6, 7, 8]], [], set())
    cfg = tuner.TuneConfig(repeats=1, batches=(1, 2), contexts=(8, 16), calib_tokens=4)
    rec = tuner.profile_and_record(cfg, setup, tuner.FormatSurvey({}, [], None, {}), lambda msg: None)
    assert rec.profile.meta["load"]["flash_attn"] is False
    assert len(rec.traces) == 1 and len(rec.traces[0].target) == 4


# ---- the tuned choice as everyone's default -------------------------------------------------------
def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "via_edge", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture()
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(tmp_path))
    return tmp_path


def write_choice(mode="sd", **knobs):
    from via_edge.files import write_json
    from via_edge.tune.store import TunedConfig, tuned_path

    modes = {"ar": {}, "sd": {"n_draft": 3, **knobs}, "via": {"n_draft": 2, "tau_accept": 0.7, "tau_full": 0.5}}
    return write_json(tuned_path("smollm2", "choice"), TunedConfig("smollm2", mode, "0-19", modes, "test").to_dict())


@pytest.mark.slow
def test_engine_and_cli_use_the_tuned_choice(model_dir, smollm2):
    write_choice()
    with Engine.from_pair("smollm2", n_ctx=512) as engine:
        assert engine.mode == "sd" and engine.spec.n_draft == 3 and engine.mode_specs["via"].tau_accept == 0.7
        res = engine.generate("Name a colour.", max_tokens=12)
        assert res.mode == "sd" and res.stats.draft_n <= 3 * res.stats.rounds
    with Engine.from_pair("smollm2", n_ctx=512, overrides={"n_draft": 2}) as engine:
        assert engine.spec.n_draft == 2 and engine.mode_specs["via"].n_draft == 2
    with Engine.from_pair("smollm2", n_ctx=512, tuned=False) as engine:
        assert engine.mode == "lookup" and engine.spec == SpecParams()  # the untuned default

    env = {**os.environ}
    out = cli("generate", "Name a colour.", "--pair", "smollm2", "-n", 8, "--json", "--ctx", 512, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mode"] == "sd"
    out = cli("generate", "Name a colour.", "--pair", "smollm2", "-n", 8, "--json", "--ctx", 512, "--untuned", env=env)
    assert json.loads(out.stdout)["mode"] == "lookup"  # the untuned default
    out = cli("generate", "Name a colour.", "--pair", "smollm2", "-n", 8, "--json", "--ctx", 512, "--mode", "ar",
              env=env)
    assert json.loads(out.stdout)["mode"] == "ar"


def test_a_choice_made_on_another_build_is_not_applied(model_dir, smollm2):
    """Tuned choices are keyed by CPU and llama.cpp build: one from another (here: renamed to a
    foreign machine key) is ignored with a warning that says to re-tune."""
    path = write_choice()
    path.rename(path.with_name("smollm2--other-cpu-2c-00000000.choice.json"))
    out = cli("generate", "Name a colour.", "--pair", "smollm2", "-n", 4, "--json", "--ctx", 512)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mode"] != "sd"  # the stored choice (sd) was not applied
    assert "another machine or llama.cpp build (other-cpu-2c-00000000)" in out.stderr
    assert "run `via-edge tune --pair smollm2` here" in out.stderr


def test_lookup_takes_ars_place_when_no_slower():
    from via_edge.tune.choose import Candidate, copy_drafting_over_ar

    ar = Candidate("ar", SpecParams(), None, 1.0, 10.0, 0.0, 1.0, {})
    look = Candidate("lookup", SpecParams(copy_max=16), None, 1.01, 10.1, 0.0, 1.0, {})
    best = {"ar": ar, "lookup": look}

    def checks(lookup_speed):
        return {"ar": {"measured_speedup": 1.0}, "lookup": {"measured_speedup": lookup_speed}}
    assert copy_drafting_over_ar(ar, "chose ar", best, checks(0.99), "shipped")[0] is look
    assert copy_drafting_over_ar(ar, "chose ar", best, checks(0.95), "shipped")[0] is ar  # measured slower
    sd = Candidate("sd", SpecParams(), None, 1.3, 13.0, 0.0, 1.0, {})
    assert copy_drafting_over_ar(sd, "chose sd", {**best, "sd": sd}, checks(1.2), "shipped")[0] is sd
    # ar on another format than the checks were run on: nothing measured to compare with
    q4 = Candidate("ar", SpecParams(), None, 1.2, 12.0, 0.0, 1.0, {}, "q4_0")
    assert copy_drafting_over_ar(q4, "chose ar", best, checks(1.3), "shipped")[0] is q4


def test_corrupt_choice_is_one_clear_error(model_dir, smollm2):
    path = write_choice()
    path.write_text("{not json")
    out = cli("generate", "hi", "--pair", "smollm2", "-n", 4, "--ctx", 512)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and str(path) in out.stderr and "via-edge tune" in out.stderr


def test_bench_tuned_needs_a_tuned_pair(model_dir, smollm2):
    out = cli("bench", "--pair", "smollm2", "--tuned", "--no-peers", "--categories", "coding", "-n", 4,
              "--out", model_dir / "b")
    assert out.returncode == 2 and "via-edge tune" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_runs_tuned_beside_default(model_dir, smollm2):
    write_choice()
    out = cli("bench", "--pair", "smollm2", "--tuned", "--no-peers", "--categories", "coding", "-n", 8,
              "--modes", "ar,sd,via", "--ctx", 1024, "--out", model_dir / "b")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((model_dir / "b" / "results.json").read_text())
    assert res["meta"]["methods"] == ["ar", "sd", "via", "sd:tuned", "via:tuned"]
    spec = res["meta"]["params"]["spec"]
    assert spec["sd"]["n_draft"] == 6 and spec["sd:tuned"]["n_draft"] == 3 and spec["via:tuned"]["tau_accept"] == 0.7
    assert res["summary"]["sd:tuned"]["lossless"] and not res["summary"]["via:tuned"]["lossless"]
    assert res["meta"]["models"]["slim:tuned"]["blocks"] == 20 and res["meta"]["models"]["slim"]["blocks"] == 22
    assert "sd:tuned" in (model_dir / "b" / "report.md").read_text()


@pytest.mark.slow
def test_tune_command_end_to_end(model_dir, smollm2):
    """The real command on SmolLM2 at its smallest settings: profile, choice and report written."""
    out = cli("tune", "--pair", "smollm2", "--repeats", 1, "--search-evals", 3, "--calib-tokens", 12, "--heldout", 1,
              "--verify-tokens", 12, "--ctx", 1536, "--formats", "shipped,q4_0", "--quality-floor", 0,
              "--screen-floor", 0, "--out", model_dir / "report")  # every stage: no slim mode screened out
    assert out.returncode == 0, out.stderr[-3000:]
    choice = json.loads(next((model_dir / "tuned").glob("smollm2--*.choice.json")).read_text())
    profile = json.loads(next((model_dir / "tuned").glob("smollm2--*.profile.json")).read_text())
    assert choice["summary"] in out.stdout
    assert set(profile["table"]) >= {"target", "draft"} and profile["batches"] == [1, 2, 3, 4, 6, 8, 12, 16]
    result = json.loads((model_dir / "report" / "tune.json").read_text())
    assert choice == result["choice"] and choice["mode"] in result["best"]  # stored = reported = a mode's best
    assert choice["modes"][choice["mode"]] == result["best"][choice["mode"]]["spec"]
    for mode, check in result["verify"].items():  # each measured ratio is this run's tok/s over ar's
        assert check["tok_s"] > 0 and min(check["speedup_spread"]) * (1 - 1e-9) <= check["measured_speedup"] <= max(
            check["speedup_spread"]) * (1 + 1e-9), mode
    assert {c["mode"] for c in result["candidates"]} == {"ar", "sd", "lookup", "hier", "via"}
    for mode, c in result["best"].items():  # held-out runs only for the modes that can be chosen
        ran = mode in ("ar", "lookup", result["predicted_choice"]["mode"]) or c["speedup"] >= 1.15
        assert (mode in result["verify"]) == ran, mode
        assert ran or any(x.startswith(f"{mode} not run") for x in result["meta"]["skipped"])
    # the format step: measured rows for both formats, and with floor 0 every mode replayed on q4_0 too
    rows = result["formats"]["target"]
    assert [r["format"] for r in rows] == ["shipped", "q4_0"] and rows[1]["quality"]["positions"] > 0
    assert all(r["cost_ms"]["1"] > 0 for r in rows)
    assert {c["mode"] for c in result["candidates"] if c["format"] == "q4_0"} == {"ar", "sd", "lookup", "hier", "via"}
    assert choice["target_format"] in ("shipped", "q4_0") and choice["draft_format"] == "shipped"
    assert all(c["format"] == choice["target_format"] for c in result["best"].values())
    assert (model_dir / "report" / "report.md").read_text().startswith("# via-edge tune: smollm2")
    # what this run made and did not choose is gone; what the choice loads is there
    from via_edge.weights.derived import derived_files, in_use
    kept = derived_files()
    used = in_use(kept)
    assert result["removed"] and not any(Path(p).exists() for p in result["removed"])
    assert {d.kind for d in kept if d.path not in used} <= {"slim 0-14"}  # the pair's draft, made before
    assert (choice["target_format"] == "q4_0") == any(d.kind == "format q4_0" and d.path in used for d in kept)
    fewer = cli("tune", "--pair", "smollm2", "--formats", "shipped")  # refused before any work
    assert fewer.returncode == 2 and "--replace" in fewer.stderr and "q4_0" in fewer.stderr
    bad = cli("tune", "--pair", "smollm2", "--slim-budget", "1.5")
    assert bad.returncode == 2 and "slim-budget" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli("tune", "--pair", "smollm2", "--screen-floor", "-1")
    assert bad.returncode == 2 and "screen-floor" in bad.stderr and "Traceback" not in bad.stderr


# ---- sampled decoding through the replay's machinery ---------------------------------------------
class Recorder:
    """A real model behind the scorer interface, keeping a copy of every answer it gave."""

    def __init__(self, scored):
        self.scored, self.calls = scored, []
        self.n_ctx = scored.n_ctx

    @property
    def tokens(self):
        return self.scored.tokens

    def eval(self, tokens, n_rows=1):
        rows = self.scored.eval(tokens, n_rows).logits.copy()
        self.calls.append(("eval", list(tokens), n_rows, rows))
        return LogitRows(rows)

    def decode(self, tokens):
        rows = self.scored.decode(tokens).logits.copy()
        self.calls.append(("decode", list(self.scored.tokens), 1, rows))  # what the cache then holds
        return LogitRows(rows)

    def is_eog(self, token):
        return self.scored.is_eog(token)


class Playback(MeteredKV):
    """The recorded answers played back, priced by the replay's own MeteredKV (what TraceModel is)."""

    def __init__(self, role, rec, meter, start):
        super().__init__(role, role, meter, start)
        self.calls, self.n_ctx, self.eog = list(rec.calls), rec.n_ctx, rec.is_eog

    def _rows(self, tokens, n_rows):
        k, want, n, rows = self.calls.pop(0)
        assert (want, n) == (list(tokens), n_rows), f"the replayed loop asked something else than its {k}"
        return LogitRows(rows)

    def is_eog(self, token):
        return self.eog(token)


@pytest.mark.parametrize("mode", ["sd", "hier", "via"])
def test_replay_machinery_reproduces_sampled_runs(recorded, mode):
    """Sampled decoding, recorded once on the real models and played back through the replay's
    meter: the same seed commits the same tokens, and the meter counts exactly the calls and
    decoded tokens llama.cpp did (LlamaModel.eval's prefix rule, shared, not mirrored)."""
    from via_edge.decode.drafters import ModelDrafter
    from via_edge.decode.loop import Decoder
    from via_edge.decode.sampling import SamplingParams
    from via_edge.decode.scores import ScoredModel
    from via_edge.decode.stats import Stats
    from via_edge.tune.replay import Meter

    engine, toks, *_ = recorded[0]
    sp = SamplingParams(temperature=0.9, top_k=20, seed=11)
    spec = SpecParams(n_draft=3, tau_accept=0.8, tau_full=0.2, hier_block=6)
    prompt = toks[2]
    roles = {"target": engine.target, "draft": engine.models.draft, "slim": engine.models.slim}
    for m in roles.values():
        m.reset()
        m.seqs[0].prefill(prompt[:-1])
    before = {r: replace(m.usage) for r, m in roles.items()}
    rec = {r: Recorder(ScoredModel(m)) for r, m in roles.items()}
    real = list(Decoder(rec["target"], ModelDrafter(rec["draft"]), rec["slim"], spec).generate(
        prompt, mode, sp, 30, Stats()))
    meter = Meter(lambda *_: 0.0)
    play = {r: Playback(r, rec[r], meter, prompt[:-1]) for r in roles}
    again = list(Decoder(play["target"], ModelDrafter(play["draft"]), play["slim"], spec).generate(
        prompt, mode, sp, 30, Stats()))
    assert again == real and len({c.origin for c in real}) >= 2  # drafts were accepted and corrected
    for r, m in roles.items():
        used = m.usage.since(before[r])
        assert (meter.calls[r], meter.tokens[r]) == (used.calls, used.tokens), r
        assert not play[r].calls, r  # every recorded answer was asked for
