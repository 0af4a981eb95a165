"""Long prompts decoded on the target's copy without weight repacking, the KV cache handed over
(llama/prefill.py). On the tiny F32 model both copies run the same kernels, so every answer must
be exactly the one the target gets by decoding its prompts itself."""

import json

import pytest
from conftest import EXACT

from via_edge import Engine
from via_edge.decode import costs
from via_edge.llama.prefill import MIN_TOKENS

PROMPT = [3 + (i * 7) % 50 for i in range(150)]


@pytest.fixture(scope="module")
def helped(tiny_target):
    with Engine(tiny_target, mode="ar", prefill_helper=True, **EXACT) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(tiny_target):
    with Engine(tiny_target, mode="ar", prefill_helper=False, **EXACT) as engine:
        yield engine


def test_a_long_prompt_is_decoded_on_the_copy_and_handed_over(helped, alone):
    helped.reset()
    alone.reset()
    helper = helped.target.prefiller.helper
    assert alone.target.prefiller is None
    before = helper.usage.tokens
    got = helped.generate(PROMPT, max_tokens=24)
    want = alone.generate(PROMPT, max_tokens=24)
    assert helper.usage.tokens - before == len(PROMPT)  # the copy decoded the whole prompt ...
    assert got.tokens == want.tokens  # ... and the target generated from its KV cache
    assert got.stats.prefilled_tokens == len(PROMPT)  # the prompt speed counts the copy's decode


def test_a_follow_up_hands_over_what_the_target_generated_since(helped, alone):
    """The second request repeats the first with its answer and a long new tail: the copy holds
    the first prompt only, so it first takes the answer's KV from the target."""
    helped.reset()
    alone.reset()
    first = helped.generate(PROMPT, max_tokens=16)
    assert first.tokens == alone.generate(PROMPT, max_tokens=16).tokens
    follow = PROMPT + first.tokens + [5 + (i * 11) % 40 for i in range(MIN_TOKENS + 10)]
    helper = helped.target.prefiller.helper
    before = helper.usage.tokens
    got = helped.generate(follow, max_tokens=24)
    assert helper.usage.tokens - before == len(follow) - got.stats.cache_tokens
    assert got.stats.cache_tokens >= len(PROMPT)
    assert got.tokens == alone.generate(follow, max_tokens=24).tokens


def test_a_short_new_tail_stays_on_the_target(helped):
    helped.reset()
    helped.generate(PROMPT, max_tokens=4)
    helper = helped.target.prefiller.helper
    before = helper.usage.tokens
    helped.generate(PROMPT + [7, 8, 9], max_tokens=4)
    assert helper.usage.tokens == before


def test_under_slots_long_prompts_take_turns_on_the_copy(tiny_target, alone):
    """Four slots, three long prompts and a short one at once: the copy's one sequence decodes each
    long prompt in turn (all but its last token, which the first round decodes) and hands it to
    its own slot; the short one stays in the shared batches. Every answer is its prompt's alone.
    Batches of 8 tokens cut each prompt into chunks that would interleave on an unguarded copy."""
    longs = [PROMPT, [9 + (i * 13) % 47 for i in range(120)], [6 + (i * 5) % 41 for i in range(100)]]
    prompts = longs[:2] + [[4, 9, 2]] + longs[2:]
    want = [alone.generate(p, max_tokens=16).tokens for p in prompts]
    with Engine(tiny_target, mode="ar", n_parallel=4, prefill_helper=True, n_batch=8,
                **{**EXACT, "n_ctx": 4 * 512}) as par:
        helper = par.target.prefiller.helper
        assert helper.seqs[0].n_ctx == par.target.seqs[0].n_ctx == 512  # one sequence, as long as a slot's
        before = helper.usage.tokens
        got = par.generate_batch(prompts, max_tokens=16)
        assert [r.tokens for r in got] == want
        assert helper.usage.tokens - before == sum(len(p) - 1 for p in longs)
        assert [r.stats.prefilled_tokens for r in got] == [len(p) - 1 for p in prompts]


def test_a_generation_away_on_the_copy_does_not_hold_up_the_shared_steps(tiny_target):
    """While one slot's prompt is on the copy (`Scheduler.away`), the step of another slot's call
    runs at once, not after the scheduler's linger waiting for the absent slot (here a minute)."""
    import threading

    from via_edge.batching import BatchedSeq, Scheduler
    from via_edge.llama import LlamaModel, LoadParams

    with LlamaModel(tiny_target, LoadParams(**{**EXACT, "n_ctx": 2 * 256}, n_seq=2)) as m:
        sched = Scheduler(linger=60.0)
        sched.enter()
        sched.enter()
        done = threading.Event()
        with sched.away():
            worker = threading.Thread(target=lambda: (BatchedSeq(m.seqs[1], sched).decode([3, 4, 5]), done.set()))
            worker.start()
            assert done.wait(20), "the present slot's step waited for the absent one"
        worker.join()
        sched.close()


def stored_path(tiny_target):
    from via_edge.llama import LlamaModel, LoadParams

    with LlamaModel(tiny_target, LoadParams(n_ctx=512)) as m:
        return costs._prompt_path(m)


@pytest.mark.parametrize("repacked, attached", [(1.0, False), (2.0, True)])
def test_by_default_the_stored_measurement_decides(tiny_target, repacked, attached):
    """With repacking on and no choice given, the stored measurement decides, nothing is measured
    again: the copy is used where it decodes prompts at least 1.15x faster."""
    path = stored_path(tiny_target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": tiny_target.name, "tokens": 128, "repacked": repacked, "plain": 1.0}))
    with Engine(tiny_target, mode="ar", n_ctx=512, use_extra_bufts=True) as engine:
        assert (engine.target.prefiller is not None) == attached
    assert json.loads(path.read_text())["repacked"] == repacked
    assert (tiny_target.name, repacked) in costs.stored_prompt_gains()  # what `via-edge info` lists


def test_by_default_the_first_load_measures_and_stores(tiny_target):
    path = stored_path(tiny_target)
    path.unlink(missing_ok=True)
    with Engine(tiny_target, mode="ar", n_ctx=512, use_extra_bufts=True):
        pass
    stored = json.loads(path.read_text())
    assert stored["tokens"] > 0 and stored["repacked"] > 0 and stored["plain"] > 0


def test_a_refused_state_leaves_the_sequence_empty_and_usable(tiny_target):
    """A hand-over llama.cpp refuses (here a truncated state) raises, and the sequence is empty,
    not out of step with its KV cache: the same prompt then decodes to the same logits."""
    import numpy as np

    from via_edge.llama import LlamaModel, LoadParams

    with LlamaModel(tiny_target, LoadParams(**EXACT)) as m:
        s = m.seqs[0]
        want = np.array(s.decode(PROMPT[:20], "last"))
        state = s.state()
        with pytest.raises(RuntimeError, match="refused"):
            s.set_state(state[:len(state) // 2], PROMPT[:20])
        assert s.tokens == []
        np.testing.assert_array_equal(np.array(s.decode(PROMPT[:20], "last")), want)
