"""Stop strings, streaming text and the sampling distributions, on hand-made inputs."""

import numpy as np
import pytest

from via_edge.decode.sampling import Dist, SamplingParams, dist, ratio_to_top, top_prob
from via_edge.decode.text import StopMatcher
from via_edge.errors import InvalidParameterError


def feed_all(matcher, pieces):
    out, hit = [], False
    for p in pieces:
        text, hit = matcher.feed(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    return "".join(out), hit


def test_stop_string_split_across_pieces():
    text, hit = feed_all(StopMatcher(["###"]), ["ab#", "#", "#cd"])
    assert (text, hit) == ("ab", True)


def test_held_back_text_is_released_when_no_stop_follows():
    m = StopMatcher(["</end>"])
    shown, hit = m.feed("x </e")
    assert shown == "x " and not hit  # "</e" could begin the stop string: held back
    assert feed_all(m, ["nd!"]) == ("</end!", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopMatcher(["b", "abc"]), ["xxabc"]) == ("xx", True)
    assert feed_all(StopMatcher(["c", "ab"]), ["xxa", "bc"]) == ("xx", True)


def test_no_stops_passes_everything():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                    dict(min_p=1.0), dict(min_p=-0.1), dict(seed=-3),
                                    dict(temperature=float("nan"))])
def test_invalid_sampling_values(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def reference_probs(logits, t, k, p, mp):
    """Straightforward sort-based version of llama.cpp's chain, to check the fast one against."""
    x = logits.astype(np.float64)
    soft = np.exp(x - x.max())
    soft /= soft.sum()
    order = np.argsort(-soft, kind="stable")
    keep = np.zeros_like(soft, dtype=bool)
    keep[order[: k or len(x)]] = True
    if p < 1:
        cum = np.cumsum(soft[order[: k or len(x)]] / soft[keep].sum())
        n = np.searchsorted(cum, p) + 1
        keep[:] = False
        keep[order[:n]] = True
    keep &= soft >= mp * soft.max()
    y = np.where(keep, x / t, -np.inf)
    out = np.exp(y - y.max())
    return out / out.sum()


@pytest.mark.parametrize("t,k,p,mp", [(1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
                                      (1.0, 0, 1.0, 0.05), (0.8, 50, 0.8, 0.02), (1.0, 0, 0.999, 0.0)])
def test_probs_match_reference(t, k, p, mp):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(5000) * 3).astype(np.float32)
    got = dist(logits, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp)).dense(len(logits))
    ref = reference_probs(logits, t, k, p, mp)
    assert got.dtype == np.float32 and np.array_equal(got > 0, ref > 0)  # the same tokens kept
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-8)  # float32 arithmetic


def test_scores_without_full_softmax():
    logits = np.array([0.0, 2.0, 1.0], dtype=np.float32)
    e = np.exp(logits - 2.0)
    assert ratio_to_top(logits, 2) == pytest.approx(np.exp(-1.0))
    best, p = top_prob(logits)
    assert best == 1 and p == pytest.approx(1 / e.sum())


def test_sample_frequencies():
    p = np.array([0.5, 0.25, 0.125, 0.125])
    rng = np.random.default_rng(1)
    counts = np.bincount([Dist(p).sample(rng) for _ in range(20000)], minlength=4) / 20000
    assert np.abs(counts - p).max() < 0.015  # ~4 standard errors at n=20000
    sparse = Dist(np.array([0.75, 0.25]), np.array([3, 9]))  # on its support: ids come back
    counts = np.bincount([sparse.sample(rng) for _ in range(20000)], minlength=10) / 20000
    assert np.abs(counts - sparse.dense(10)).max() < 0.015


@pytest.mark.parametrize("q_ids", [None, [1, 2, 5]])
@pytest.mark.parametrize("p_ids", [None, [0, 2, 5, 7]])
def test_residual_is_the_clipped_difference_on_any_supports(p_ids, q_ids):
    """max(0, p - q) renormalised, whichever of p and q is held sparse, compared with dense
    arithmetic; nothing left gives p back."""
    rng = np.random.default_rng(4)
    dense_p, dense_q = np.zeros(8), np.zeros(8)
    dense_p[p_ids if p_ids is not None else slice(None)] = rng.random(len(p_ids) if p_ids else 8)
    dense_q[q_ids if q_ids is not None else slice(None)] = rng.random(len(q_ids) if q_ids else 8)
    dense_p /= dense_p.sum()
    dense_q /= dense_q.sum()

    def held(dense, ids):
        return Dist(dense) if ids is None else Dist(dense[ids], np.array(ids))

    p, q = held(dense_p, p_ids), held(dense_q, q_ids)
    want = np.maximum(dense_p - dense_q, 0)
    assert np.allclose(p.residual(q).dense(8), want / want.sum())
    assert [p.prob(t) for t in range(8)] == pytest.approx(list(dense_p))
    assert np.allclose(p.residual(p).dense(8), dense_p)  # p - p leaves nothing: p itself


def test_prompt_speed_counts_the_tokens_the_prefill_decoded(tiny_engine):
    """With one slot the prompt's decode covers all of it (its last row gives the first answer
    token); a request that extends the cached one decodes only what is new. A count of the prompt
    (with the cached tokens, or without its last) would misstate a chat turn's prefill speed."""
    tiny_engine.reset()
    first = list(range(3, 40))
    a = tiny_engine.generate(first, mode="ar", max_tokens=3)
    assert a.stats.cache_tokens == 0 and a.stats.prefilled_tokens == len(first)
    second = first + a.tokens + list(range(50, 60))
    b = tiny_engine.generate(second, mode="ar", max_tokens=3)
    assert b.stats.cache_tokens >= len(first)
    assert b.stats.prefilled_tokens == len(second) - b.stats.cache_tokens
    assert b.stats.prompt_tokens_per_second == pytest.approx(b.stats.prefilled_tokens / b.stats.prefill_seconds)
