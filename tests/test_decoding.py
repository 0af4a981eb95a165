"""The decoding modes on tiny F32 models: exactness where the maths promises it, statistics where
it is random, and KV caches that always match the committed text."""

import numpy as np
import pytest
from chi2 import chi2_sf
from conftest import EXACT, make_tiny_gguf

from via_edge import Engine, SpecParams
from via_edge.decode.sampling import SamplingParams, dist
from via_edge.errors import InvalidParameterError
from via_edge.llama import LlamaModel, LoadParams

PROMPTS = ["hello world", "the cat is here", "a", "some more words in here", "xyz 123", "é ü 世界"]


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """Three tiny targets (different seeds), each with a 2-block draft and a 3-block slim."""
    out = []
    for seed in (1, 7, 11):
        path = make_tiny_gguf(tiny_dir / f"dec{seed}.gguf", blocks=4, seed=seed)
        out.append(Engine(path, draft_layers="0-1", slim_layers="0-2", **EXACT))
    yield out
    for e in out:
        e.close()


def run(engine, prompt, mode, **kw):
    kw.setdefault("max_tokens", 60)
    return engine.generate(prompt, mode=mode, chat_template=False, **kw)


@pytest.fixture(scope="module")
def references(engines):
    """`ar`'s greedy answer per (engine, prompt), made once: what every lossless mode must equal."""
    return {(i, p): run(e, p, "ar") for i, e in enumerate(engines) for p in PROMPTS}


@pytest.mark.parametrize("n_draft", [1, 2, 3, 5, 8])
def test_greedy_sd_hier_lookup_equal_ar(engines, references, n_draft):
    spec = SpecParams(n_draft=n_draft, hier_block=max(2, 2 * n_draft))
    accepted = rejected = 0
    for i, engine in enumerate(engines):
        for prompt in PROMPTS:
            ar = references[(i, prompt)]
            for mode in ("sd", "hier", "lookup"):
                res = run(engine, prompt, mode, spec=spec)
                assert res.tokens == ar.tokens, (mode, prompt)
                assert res.text == ar.text and res.finish_reason == ar.finish_reason
                if mode == "sd":
                    accepted += res.stats.draft_n_accepted
                    rejected += res.stats.rejected
    assert accepted > 0 and rejected > 0  # both paths of the rule were exercised


def test_eos_inside_a_draft(engines):
    """Some greedy outputs end on EOS that the draft proposed and the target accepted."""
    seen = 0
    for engine in engines:
        for prompt in PROMPTS:
            ar = run(engine, prompt, "ar", max_tokens=120)
            if ar.finish_reason != "stop":
                continue
            for mode in ("sd", "hier"):
                res = run(engine, prompt, mode, max_tokens=120, spec=SpecParams(n_draft=8))
                assert res.tokens == ar.tokens and res.finish_reason == "stop"
                seen += res.origins[-1] == "draft" and mode == "sd"
    assert seen > 0


def test_stop_strings_across_rounds(engines):
    engine, prompt, text = next((e, p, r.text) for e in engines for p in PROMPTS
                                if len((r := run(e, p, "ar", max_tokens=80)).text) > 40)
    for start in range(3, 40, 7):
        stop = text[start:start + 4]
        expected = text[: text.find(stop)]
        for mode in ("ar", "sd", "hier"):
            res = run(engine, prompt, mode, max_tokens=80, stop=[stop], spec=SpecParams(n_draft=4))
            assert res.text == expected and res.finish_reason == "stop", (mode, stop)


def test_streamed_pieces_are_the_targets_text(engines):
    """Streamed text is what the target's vocabulary makes of the committed tokens, and the same
    text plain decoding gives: no piece dropped, doubled or cut inside a character."""
    for engine in engines:
        for prompt in ("é ü 世界", "hello world"):
            ar = run(engine, prompt, "ar", max_tokens=40)
            stream = engine.stream(prompt, mode="sd", chat_template=False, max_tokens=40)
            pieces = list(stream)
            tokens = [t for t in stream.result.tokens if not engine.target.is_eog(t)]
            assert "".join(p.text for p in pieces) == engine.target.detokenize(tokens) == ar.text


def test_a_stream_read_early_has_its_own_result(engines):
    """Stopping after three pieces ends the generation as cancelled, with exactly the text read so
    far; the result is this call's, never a previous one's."""
    engine = engines[0]
    full = run(engine, "hello world", "sd", max_tokens=40)
    assert len(full.tokens) > 6
    stream = engine.stream("the cat is here", mode="sd", chat_template=False, max_tokens=40)
    read = [next(stream) for _ in range(3)]
    res = stream.result  # ends the generation here
    assert res.finish_reason == "cancelled" and res.text == "".join(p.text for p in read)
    assert res.tokens == run(engine, "the cat is here", "ar", max_tokens=40).tokens[:len(res.tokens)]
    assert res.stats.generated_tokens == len(res.tokens) < 40 and res.stats.prompt_tokens > 0
    with pytest.raises(StopIteration):
        next(stream)
    for piece in engine.stream("hello world", mode="sd", chat_template=False, max_tokens=40):
        break  # a for loop broken off: the stream object is gone, the engine is fine
    assert run(engine, "hello world", "sd", max_tokens=40).tokens == full.tokens


def test_via_with_tau_full_above_one_is_sd(engines):
    spec_sd = SpecParams(n_draft=4)
    spec_via = SpecParams(n_draft=4, tau_full=1.5)
    for engine in engines:
        for prompt in PROMPTS[:4]:
            sd = run(engine, prompt, "sd", spec=spec_sd)
            via = run(engine, prompt, "via", spec=spec_via)
            assert via.tokens == sd.tokens and via.origins == sd.origins
            assert via.stats.tier_a == via.stats.tier_b == 0
            assert via.stats.slim.calls == 0


def test_via_with_tau_accept_zero_is_the_drafts_own_output(engines):
    spec = SpecParams(n_draft=4, tau_accept=0.0, tau_full=0.0, max_lag=0)
    for engine in engines:
        draft_only = Engine(engine.models.draft.path, **EXACT)
        for prompt in PROMPTS[:4]:
            via = run(engine, prompt, "via", spec=spec)
            own = run(draft_only, prompt, "ar")
            assert via.tokens == own.tokens
            prompt_only = len(engine.tokens_for(prompt, False))  # the prompt in one decode (Seq.prime), nothing after
            assert via.stats.target.tokens <= prompt_only and via.stats.tier_a == len(via.tokens)
        draft_only.close()


def test_via_with_the_whole_target_as_slim_is_exact(tiny_target):
    """A slim of every block is the target: tier A (score 1 = its argmax) and tier B (its argmax)
    both give the target's greedy token, and the target itself never runs after the prompt."""
    spec = SpecParams(n_draft=4, tau_accept=1.0, tau_full=0.0, max_lag=0)
    with Engine(tiny_target, draft_layers="0-1", slim_layers="0-3", **EXACT) as engine:
        for prompt in PROMPTS:
            ar = run(engine, prompt, "ar")
            via = run(engine, prompt, "via", spec=spec)
            assert via.tokens == ar.tokens
            assert set(via.tiers) <= {"A", "B"} and via.stats.tier_b_replaced > 0
            assert via.stats.target.tokens <= len(engine.tokens_for(prompt, False))  # the prompt only (Seq.prime)


def test_via_routes_by_the_slims_score(engines):
    """Every tier-A and tier-B token, rescored by the slim alone on its committed context, has the
    score its tier promises; a tier-B token the slim produced is the slim's argmax; and the
    per-tier counters agree with the tiers the tokens carry."""
    tau_a, tau_f, eps = 0.99, 0.05, 1e-3  # eps: batched vs single F32 logits differ by ~1e-5
    seen = set()
    for engine, text in zip(engines, PROMPTS):
        prompt = engine.tokens_for(text, False)
        res = run(engine, prompt, "via", max_tokens=80,
                  spec=SpecParams(n_draft=5, tau_accept=tau_a, tau_full=tau_f, max_lag=8))
        with LlamaModel(engine.models.slim.path, LoadParams(**EXACT)) as slim:
            for i, (tok, origin, tier) in enumerate(zip(res.tokens, res.origins, res.tiers)):
                if tier == "C":
                    continue
                row = slim.seqs[0].eval(prompt + res.tokens[:i], 1)[0]
                r = float(np.exp(row[tok] - row.max()))
                if tier == "A":
                    assert origin == "draft" and r >= tau_a - eps, (i, r)
                elif origin == "slim":
                    assert tok == int(row.argmax()), i
                else:
                    assert origin == "draft" and tau_f - eps <= r < tau_a + eps, (i, r)
                seen.add((tier, origin))
        s = res.stats
        assert (s.tier_a, s.tier_b, s.tier_c) == tuple(res.tiers.count(t) for t in "ABC")
        assert s.tier_b_replaced == res.origins.count("slim") and s.draft_n_accepted == res.origins.count("draft")
    assert {("A", "draft"), ("B", "slim")} <= seen  # both checks ran


def test_via_max_lag_bounds_unverified_tokens(engines):
    engine = engines[0]
    spec = SpecParams(n_draft=4, tau_accept=0.0, tau_full=0.0, max_lag=6)
    res = run(engine, "hello world", "via", max_tokens=60, spec=spec)
    unverified = 0
    for tier in res.tiers:
        unverified = 0 if tier == "C" else unverified + 1
        assert unverified <= 6
    assert "C" in res.tiers and "A" in res.tiers


def test_kv_caches_match_fresh_contexts(engines):
    engine = engines[2]
    specs = [SpecParams(n_draft=3), SpecParams(n_draft=6, tau_accept=0.97, tau_full=0.5, max_lag=5)]
    for mode, spec in [("sd", specs[0]), ("via", specs[1]), ("hier", specs[0]), ("sd", specs[1])]:
        prompt = "the cat is here"
        res = run(engine, prompt, mode, max_tokens=37, spec=spec)
        committed = engine.tokens_for(prompt, False) + res.tokens
        for model in (engine.models.target, engine.models.draft, engine.models.slim):
            # caches may hold rejected drafts until their next call syncs them: that call must
            # give exactly what a fresh context fed the committed text gives
            got = model.seqs[0].eval(committed, 1).copy()
            with LlamaModel(model.path, LoadParams(**EXACT)) as fresh:
                want = fresh.seqs[0].eval(committed, 1)
                assert np.abs(got - want).max() < 1e-4


def test_invalid_spec_values():
    for kw in [dict(n_draft=0), dict(tau_accept=1.2), dict(tau_full=-0.1), dict(tau_full=3),
               dict(tau_accept=0.3, tau_full=0.5), dict(route="magic"), dict(max_lag=-1),
               dict(hier_block=1)]:
        with pytest.raises(InvalidParameterError):
            SpecParams(**kw)


def fit(dist, counts):
    """Chi-square p-value of `counts` drawn from `dist` (rare tokens pooled into one bin)."""
    n = counts.sum()
    big = dist * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(dist[big] * n, dist[~big].sum() * n)
    keep = exp > 0
    chi = (((obs - exp) ** 2)[keep] / exp[keep]).sum() + (obs[~keep].sum() > 0) * 1e9
    return chi2_sf(chi, keep.sum() - 1)


@pytest.mark.slow
def test_stochastic_sd_and_hier_match_target_distribution(engines):
    """First emitted token of sampled sd and hier vs the target's own softmax: chi-square at p = 0.001.

    N = 6000 draws detect a 2% shift of mass between two likely tokens with high probability;
    the same statistic computed against the draft's distribution must reject, showing the test
    has the power to see a wrong rule.
    """
    engine = engines[0]
    engine.prepare("hier")
    sp = dict(temperature=25.0)
    prompt_tokens = engine.tokens_for("the cat is here", False)
    p = dist(engine.models.target.seqs[0].eval(prompt_tokens, 1)[0], SamplingParams(**sp)).dense(engine.target.n_vocab)
    q = dist(engine.models.draft.seqs[0].eval(prompt_tokens, 1)[0], SamplingParams(**sp)).dense(engine.target.n_vocab)
    n = 6000
    assert np.abs(p - q).sum() > 0.1  # the draft really differs, so the residual path runs
    for mode in ("sd", "hier"):
        firsts = [engine.generate(prompt_tokens, mode=mode, max_tokens=2, seed=i, **sp,
                                  spec=SpecParams(n_draft=3, tau_full=0.2)).tokens[0] for i in range(n)]
        counts = np.bincount(firsts, minlength=p.size)
        assert fit(p, counts) > 0.001, mode
        assert fit(q, counts) < 0.001, mode


@pytest.mark.slow
def test_stochastic_lookup_matches_target_distribution(engines):
    """Sampled lookup: the copy is a point mass, accepted with probability p(copy), else the
    token is drawn from p without it. Every run drafts the copy at the first position; the first
    emitted token must follow the target's softmax (chi-square at p = 0.001), and the same
    statistic rejects a rule that left the rejected copy in the residual."""
    engine = engines[0]
    engine.prepare("lookup")
    engine.models.batch_cost = lambda n: 1.0  # the policy drafts whenever it sees a copy
    sp = dict(temperature=8.0)
    base = engine.tokens_for("the cat is here", False)
    said = engine.generate(base, mode="ar", max_tokens=12).tokens
    prompt_tokens = base + said + [said[0]]  # ends on a token seen once before: the copy is said[1]
    copy = said[1]
    p = dist(engine.models.target.seqs[0].eval(prompt_tokens, 1)[0], SamplingParams(**sp)).dense(engine.target.n_vocab)
    assert 0.05 < p[copy] < 0.9  # both the accept and the residual paths run often
    n = 6000
    firsts, drafted = [], 0
    for i in range(n):
        engine.reset()  # a fresh drafter: each draw is one first round
        res = engine.generate(prompt_tokens, mode="lookup", max_tokens=2, seed=i, **sp)
        firsts.append(res.tokens[0])
        drafted += res.stats.draft_n > 0
    counts = np.bincount(firsts, minlength=p.size)
    assert drafted == n
    assert fit(p, counts) > 0.001
    wrong = p * (1 - p[copy])  # a rule that left the rejected copy in the residual
    wrong[copy] = p[copy] * (2 - p[copy])
    assert fit(wrong, counts) < 0.001


def test_chi2_sf_known_values():
    # table values: P(X > x) for chi-square with k degrees of freedom
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-3
    assert abs(chi2_sf(18.307, 10) - 0.05) < 1e-3
    assert abs(chi2_sf(29.588, 10) - 0.001) < 1e-4
    assert abs(chi2_sf(124.342, 100) - 0.05) < 1e-3


def test_p_min_and_n_min_bound_the_draft(tiny_target):
    """p_min = 1 stops every draft before its first token unless n_min forces some."""
    for n_min, expected in ((0, 0), (2, 2)):
        with Engine(tiny_target, draft_layers="0-1", **EXACT) as engine:
            ar = run(engine, "hello world", "ar", max_tokens=30)
            sd = run(engine, "hello world", "sd", max_tokens=30, spec=SpecParams(n_draft=5, p_min=1.0, n_min=n_min))
            assert sd.tokens == ar.tokens
            rounds_with_room = sd.stats.rounds - 1  # the last round may be cut by the budget
            assert sd.stats.draft_n >= expected * rounds_with_room
            assert sd.stats.draft_n <= expected * sd.stats.rounds


def test_a_seeded_copy_answer_is_ars_whatever_was_cached_or_copied(engines):
    """Sampling with a seed: `lookup` verifies a copied token by drawing as `ar` would (one draw
    per committed token), so its answer is `ar`'s for the same seed, whether the slot held
    another request's prompt and copies before or nothing."""
    engine = engines[0]
    engine.prepare("lookup")
    engine.models.batch_cost = lambda n: 1.0  # the policy drafts whenever it sees a copy
    base = engine.tokens_for("the cat is here", False)
    said = engine.generate(base, mode="ar", max_tokens=16).tokens
    prompt = base + said + base + said[:2]  # the answer tends to copy what came before
    drafted = 0
    for seed in range(6):
        sp = dict(temperature=1.0, seed=seed, max_tokens=20)
        engine.reset()
        ar = engine.generate(prompt, mode="ar", **sp).tokens
        engine.reset()
        cold = engine.generate(prompt, mode="lookup", **sp)
        engine.generate(prompt[: len(prompt) // 2], mode="lookup", max_tokens=6)  # leaves a cached prefix
        warm = engine.generate(prompt, mode="lookup", **sp)
        assert cold.tokens == ar == warm.tokens, seed
        drafted += cold.stats.draft_n
    assert drafted > 0
