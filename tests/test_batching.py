"""Concurrent generations in shared decodes: nothing lost or mixed up (tiny F32 model, exact kernels)."""

import threading

import numpy as np
import pytest
from conftest import EXACT
from make_tiny_gguf import make_tiny_gguf

from via_edge import Engine
from via_edge.batching import BatchedSeq, Scheduler
from via_edge.decode.copying import CopyPolicy
from via_edge.errors import ContextOverflowError, InvalidParameterError
from via_edge.llama import LlamaModel, LoadParams
from via_edge.openai_api.responses import timings

PROMPTS = [[1 + i, 5 + 3 * i, 9, 17 + i, 2 * i + 3] for i in range(6)]
# no copy memory: it would draft from the answers given before, and the origins would differ
KW = dict(copy_memory=0, draft_layers="0-1", slim_layers="0-2", **EXACT)


@pytest.fixture(scope="module")
def solo(tiny_target):
    with Engine(tiny_target, **KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def par(tiny_target):
    with Engine(tiny_target, n_parallel=4, **{**KW, "n_ctx": 4 * 512}) as engine:
        yield engine


def test_decode_batch_rows_belong_to_their_sequence(tiny_target):
    """Several sequences in one llama_decode, given out of order: each gets the logits a
    single-sequence context computes for its own tokens."""
    with LlamaModel(tiny_target, LoadParams(n_ctx=512, kv_type="f32", flash_attn=False, use_extra_bufts=False)) as one, \
            LlamaModel(tiny_target, LoadParams(n_ctx=3 * 512, n_seq=3, kv_type="f32", flash_attn=False,
                                               use_extra_bufts=False)) as many:
        texts = [[3, 4, 5, 6], [9, 8], [11, 12, 13]]
        want = [one.seqs[0].eval(t, len(t)).copy() for t in texts]
        got = many.decode_batch([(many.seqs[2], texts[2], [0, 1, 2]), (many.seqs[0], texts[0], [0, 1, 2, 3]),
                                 (many.seqs[1], texts[1], [0, 1])])
        for w, g in zip([want[2], want[0], want[1]], got):
            np.testing.assert_allclose(g, w, atol=1e-4)
        assert [s.tokens for s in many.seqs] == texts
        many.seqs[0].truncate(2)  # one sequence rolls back; the others keep their cache
        assert many.seqs[0].tokens == [3, 4] and many.seqs[2].tokens == texts[2]
        np.testing.assert_allclose(many.seqs[2].decode([14]), one.seqs[0].eval(texts[2] + [14]), atol=1e-4)


@pytest.mark.parametrize("mode", ["ar", "lookup", "sd", "via", "hier"])
def test_concurrent_answers_equal_solo_answers(solo, par, mode):
    """Every mode runs batched per slot (drafts and slim checks share decodes too) and gives each
    prompt exactly the tokens it gets alone; the decodes really were shared."""
    alone = [solo.generate(p, mode=mode, max_tokens=20, chat_template=False) for p in PROMPTS]
    steps = par.slots.scheduler.steps
    batch = par.generate_batch(PROMPTS, mode=mode, max_tokens=20, chat_template=False)
    assert [r.tokens for r in batch] == [r.tokens for r in alone]
    assert [r.origins for r in batch] == [r.origins for r in alone]
    assert [r.finish_reason for r in batch] == [r.finish_reason for r in alone]
    calls = sum(r.stats.target.calls + r.stats.draft.calls + r.stats.slim.calls for r in batch)
    assert par.slots.scheduler.steps - steps < 0.7 * calls  # several slots per decode, not one after another
    assert batch.generated_tokens == sum(len(r.tokens) for r in alone) and batch.tokens_per_second > 0


def test_sampled_answers_follow_their_own_seed(solo, par):
    """Each generation keeps its own random stream: seeded sampling gives the solo answer, whatever
    runs beside it; another seed gives another answer."""
    kw = dict(mode="sd", max_tokens=24, chat_template=False, temperature=1.0)
    alone = [solo.generate(p, seed=7, **kw).tokens for p in PROMPTS[:4]]
    assert [r.tokens for r in par.generate_batch(PROMPTS[:4], seed=7, **kw)] == alone
    assert [r.tokens for r in par.generate_batch(PROMPTS[:4], seed=8, **kw)] != alone


def test_the_server_rate_counts_the_tokens_decoded_in_its_span(solo, par):
    """`timings.predicted_per_second` counts as llama-server's does: with one slot the prompt's
    decode gives the first token, so the span holds the others; under slots the first round
    decodes it inside the span, and every token counts."""
    for engine, outside in ((solo, 1), (par, 0)):
        r = engine.generate(PROMPTS[0], mode="ar", max_tokens=12, chat_template=False)
        n = r.stats.generated_tokens
        assert n >= 2 and r.stats.first_from_prompt == outside
        assert timings(r)["predicted_per_second"] == pytest.approx((n - outside) / r.stats.generate_seconds, rel=1e-3)


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_generations(tiny_dir):
    """A prompt longer than a batch (n_batch 512) is cut into chunks that share decodes with the
    others' next tokens; its answer is still its solo answer."""
    path = make_tiny_gguf(tiny_dir / "long.gguf", arch="qwen2", blocks=4, seed=9, context_length=2048)
    long_prompt = [(7 * i) % 200 + 3 for i in range(700)]
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    with Engine(path, mode="ar", **{**KW, "n_ctx": 1024}) as one:
        alone = [one.generate(p, max_tokens=16, chat_template=False).tokens for p in prompts]
    with Engine(path, mode="ar", n_parallel=3, **{**KW, "n_ctx": 3 * 1024}) as three:
        assert [r.tokens for r in three.generate_batch(prompts, max_tokens=16, chat_template=False)] == alone
        assert three.target.usage.tokens <= sum(len(p) + 16 for p in prompts)  # nothing decoded twice


def test_slots_limit_each_generation_to_its_share_of_the_context(tiny_target):
    with Engine(tiny_target, n_parallel=2, **{**KW, "n_ctx": 2 * 256}) as engine:
        assert (engine.target.n_ctx, engine.target.n_ctx_total) == (256, 512)
        with pytest.raises(ContextOverflowError, match="256"):
            engine.generate(list(range(3, 303)), chat_template=False)  # fits the total, not a slot
        res = engine.generate(list(range(3, 203)), max_tokens=100, chat_template=False)
        # ends at EOS or at the slot's end, not at the context's
        assert len(res.tokens) == 256 - 200 if res.finish_reason == "length" else len(res.tokens) < 256 - 200


def test_more_generations_than_slots_wait_their_turn(par):
    """Eight threads on four slots: all answers are right, and some waited (queue_seconds)."""
    prompts = PROMPTS + PROMPTS[:2]
    out = {}

    def one(i):
        out[i] = par.generate(prompts[i], max_tokens=12, chat_template=False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = par.generate_batch(prompts, max_tokens=12, chat_template=False)
    assert [out[i].tokens for i in range(len(prompts))] == [r.tokens for r in want]
    assert max(r.stats.queue_seconds for r in out.values()) > 0
    assert par.slots_busy == 0


def test_a_stream_closed_early_frees_its_slot(tiny_target):
    with Engine(tiny_target, n_parallel=2, **{**KW, "n_ctx": 2 * 512}) as engine:
        first = engine.stream(PROMPTS[0], max_tokens=50, chat_template=False)
        next(first)
        assert engine.slots_busy == 1
        for _ in engine.stream(PROMPTS[1], max_tokens=50, chat_template=False):
            break  # dropped half-read: ends as soon as it is unreferenced
        assert engine.slots_busy == 1
        first.close()
        assert engine.slots_busy == 0
        assert len(engine.generate_batch(PROMPTS[:2], max_tokens=5, chat_template=False)) == 2


def test_a_prompt_beside_running_generations_gives_the_solo_answers(solo, par):
    """A long prompt prefilled in the steps that carry short prompts and their next tokens:
    every answer is still the one its prompt gets alone, and the decodes were shared."""
    prompts = PROMPTS[:3] + [[3 + (7 * i) % 200 for i in range(45)]]
    alone = [solo.generate(p, mode="ar", max_tokens=12, chat_template=False).tokens for p in prompts]
    par.reset()
    steps = par.slots.scheduler.steps
    got = par.generate_batch(prompts, mode="ar", max_tokens=12, chat_template=False)
    assert [r.tokens for r in got] == alone
    assert par.slots.scheduler.steps - steps < sum(r.stats.target.calls for r in got)


def test_copy_drafts_in_a_shared_step_are_sized_for_the_other_slots_tokens(par, monkeypatch):
    """lookup with slots: the copy policy hears how many tokens the other generations put into
    the step (alone it would size drafts as if the decode were its own)."""
    heard: list[int] = []
    length = CopyPolicy.length

    def spy(self, run, k_max, others=0):
        heard.append(others)
        return length(self, run, k_max, others)

    monkeypatch.setattr(CopyPolicy, "length", spy)
    looping = [[5, 6, 7, 8, 9] * 6 for _ in range(4)]  # prompts a copy can continue
    par.reset()
    par.generate_batch(looping, mode="lookup", max_tokens=12, chat_template=False)
    assert heard and max(heard) >= 1


def test_a_batched_sequence_checks_its_context_and_a_closed_scheduler_refuses(tiny_target):
    with LlamaModel(tiny_target, LoadParams(n_ctx=2 * 256, n_seq=2, **{k: EXACT[k] for k in
                                                                       ("kv_type", "flash_attn",
                                                                        "use_extra_bufts")})) as m:
        sched = Scheduler()
        seq = BatchedSeq(m.seqs[0], sched)
        with pytest.raises(ContextOverflowError):
            seq.decode(list(range(3, 300)))  # longer than the sequence's 256 tokens
        assert seq.eval([3, 4, 5]).shape == (1, m.n_vocab)
        sched.close()
        with pytest.raises(RuntimeError, match="closed"):
            seq.decode([6])


@pytest.mark.parametrize("n", [0, 65])
def test_parallel_outside_1_to_64_is_refused(tiny_target, n):
    with pytest.raises(InvalidParameterError, match="n_parallel"):
        Engine(tiny_target, n_parallel=n, **KW)


@pytest.mark.parametrize("mode", ["ar", "sd", "lookup"])
def test_a_one_slot_engine_called_from_threads_answers_each_its_own(solo, mode):
    """Calls from several threads on the default one slot take turns: each gets the answer it
    gets alone (they once shared slot 0's KV cache at once and came back mixed)."""
    want = [solo.generate(p, max_tokens=24, chat_template=False, mode=mode).tokens for p in PROMPTS]
    out: dict[int, list[int]] = {}
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait()
        out[i] = solo.generate(PROMPTS[i], max_tokens=24, chat_template=False, mode=mode).tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(PROMPTS))] == want
    assert solo.slots_busy == 0


def test_a_half_read_stream_on_one_slot_lets_the_same_thread_go_on(solo):
    """A stream this thread left half-read does not block its next call (the call takes the
    turn over), and the stream, read again, still finishes with its own answer."""
    want = [solo.generate(p, max_tokens=20, chat_template=False, mode="ar").tokens for p in PROMPTS[:2]]
    first = solo.stream(PROMPTS[0], max_tokens=20, chat_template=False, mode="ar")
    next(first)
    assert solo.generate(PROMPTS[1], max_tokens=20, chat_template=False, mode="ar").tokens == want[1]
    for _ in first:
        pass
    assert first.result.tokens == want[0] and solo.slots_busy == 0
