"""Long prompts decoded on the target's copy without weight repacking, the KV cache handed over
(llama/prefill.py). On the tiny F32 model both copies run the same kernels, so every answer must
be exactly the one the target gets by decoding its prompts itself."""

import json

import numpy as np
import pytest
from conftest import EXACT, make_tiny_gguf

from via_edge import Engine
from via_edge.decode import costs
from via_edge.llama import LlamaModel, LoadParams
from via_edge.llama.prefill import MIN_TOKENS
from via_edge.llama.runtime import default_threads
from via_edge.weights import catalog, formats

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
    assert got.stats.target.helped == len(PROMPT) and want.stats.target.helped == 0


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
    got = helped.generate(PROMPT + [7, 8, 9], max_tokens=4)
    assert helper.usage.tokens == before and got.stats.target.helped == 0


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
        assert [r.stats.target.helped for r in got] == [len(p) - 1 if p in longs else 0 for p in prompts]


def test_a_generation_away_on_the_copy_does_not_hold_up_the_shared_steps(tiny_target):
    """While one slot's prompt is on the copy (`Scheduler.away`), the step of another slot's call
    runs at once, not after the scheduler's linger waiting for the absent slot (here a minute)."""
    import threading

    from via_edge.batching import BatchedSeq, Scheduler

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


def stored_path(model_file, **load):
    with LlamaModel(model_file, LoadParams(n_ctx=512, **load)) as m:
        return costs._prompt_path(m)


@pytest.fixture(scope="module")
def derived(tiny_dir):
    """A tiny F32 model and its q4_0 variant (written beside it, as for a user's own GGUF)."""
    source = make_tiny_gguf(tiny_dir / "fmt-src.gguf", arch="qwen2", blocks=2, n_embd=256, n_ff=512, seed=11,
                            tied=True)  # logits spread over the vocabulary: the format moves them
    return source, formats.derive(source, "q4_0", quiet=True)


def _top(row: np.ndarray, n: int = 5) -> list[float]:
    """The n largest log-probabilities of a row of logits (the peaked tiny models put ~0 on the
    first: the runners-up are where two weight sets show)."""
    row = row.astype(np.float64)
    lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
    return sorted(lp, reverse=True)[:n]


def test_a_derived_format_prefills_on_the_file_it_was_made_from(derived):
    """The copy of a derived format is its source file: the prompt's KV cache (and the first
    token's row, the prompt's last) are the source's, then the format generates. Reference: the
    source decodes the prompt, its state goes to the format, which goes on one token at a time;
    the answer and its top log-probabilities match it, and not the format's own prefill (q4_0
    against F32 weights: other values)."""
    source, variant = derived
    assert formats.source_file(variant) == source and formats.source_file(source) is None
    prompt = [3 + (i * 7) % 90 for i in range(80)]
    with LlamaModel(source, LoadParams(**EXACT)) as src, LlamaModel(variant, LoadParams(**EXACT)) as var:
        s, v = src.seqs[0], var.seqs[0]
        rows = [np.array(s.decode(prompt, "last")[0])]
        v.set_state(s.state(), prompt)
        for _ in range(7):
            rows.append(np.array(v.decode([int(rows[-1].argmax())], "last")[0]))
        v.reset()
        own = np.array(v.decode(prompt, "last")[0])
    with Engine(variant, mode="ar", prefill_helper=True, **EXACT) as helped:
        assert helped.target.prefiller.helper.path == source
        got = helped.generate(prompt, max_tokens=8, logprobs=5)
    assert got.tokens == [int(r.argmax()) for r in rows]
    tops = [[lp for _, lp in alts] for _, _, alts in got.logprobs]
    np.testing.assert_allclose(tops, [_top(r) for r in rows], atol=1e-3)
    assert np.abs(np.array(_top(own)) - _top(rows[0])).max() > 1e-2  # the format's own prefill is told apart


@pytest.mark.parametrize("fastest", ["plain", "source_plain"])
def test_the_stored_measurement_picks_the_faster_copy(derived, fastest):
    """Measured once: the format repacked and both unrepacked copies; the faster copy is loaded."""
    source, variant = derived
    path = stored_path(variant, use_extra_bufts=True)
    path.unlink(missing_ok=True)
    with Engine(variant, mode="ar", n_ctx=512, use_extra_bufts=True):
        pass
    got = json.loads(path.read_text())
    assert got["source"] == source.name and min(got["repacked"], got["plain"], got["source_plain"]) > 0
    times = {"repacked": 2.0, "plain": 1.0, "source_plain": 1.0, fastest: 0.5}
    path.write_text(json.dumps({"model": variant.name, "source": source.name, "tokens": 128, **times}))
    with Engine(variant, mode="ar", n_ctx=512, use_extra_bufts=True) as engine:
        assert engine.target.prefiller.helper.path == (source if fastest == "source_plain" else variant)
    copy = f"{source.name} unrepacked" if fastest == "source_plain" else "its own file unrepacked"
    assert (variant.name, 4.0, copy, str(default_threads())) in costs.stored_prompt_gains()


@pytest.mark.parametrize("repacked, attached", [(1.0, False), (2.0, True)])
def test_by_default_the_stored_measurement_decides(tiny_target, repacked, attached):
    """With repacking on and no choice given, the stored measurement decides, nothing is measured
    again: the copy is used where it decodes prompts at least 1.15x faster."""
    path = stored_path(tiny_target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": tiny_target.name, "tokens": 128, "repacked": repacked, "plain": 1.0}))
    with Engine(tiny_target, mode="ar", n_ctx=512, use_extra_bufts=True) as engine:
        assert (engine.target.prefiller is not None) == attached
    # as many threads as the default takes: the same setting, the same measurement (a bench asks for them)
    assert stored_path(tiny_target, n_threads=default_threads()) == path
    with Engine(tiny_target, mode="ar", n_ctx=512, use_extra_bufts=True, n_threads=default_threads()) as engine:
        assert (engine.target.prefiller is not None) == attached
    assert json.loads(path.read_text())["repacked"] == repacked
    gains = costs.stored_prompt_gains()  # `info`
    assert (tiny_target.name, repacked, "its own file unrepacked", str(default_threads())) in gains


def test_by_default_the_first_load_measures_and_stores(tiny_target):
    """The first load measures (and says so on the status line); the next reads it back silently."""
    path = stored_path(tiny_target)
    path.unlink(missing_ok=True)
    said: list[str] = []
    for _ in range(2):
        with Engine(tiny_target, mode="ar", n_ctx=512, use_extra_bufts=True,
                    progress=lambda what, frac: said.append(what)):
            said.append("loaded")
    stored = json.loads(path.read_text())
    assert stored["tokens"] > 0 and stored["repacked"] > 0 and stored["plain"] > 0
    first, second = said[:said.index("loaded")], said[said.index("loaded") + 1:]
    assert first.count("prompt costs") == 2 and "prompt costs" not in second


def test_a_refused_state_leaves_the_sequence_empty_and_usable(tiny_target):
    """A hand-over llama.cpp refuses (here a truncated state) raises, and the sequence is empty,
    not out of step with its KV cache: the same prompt then decodes to the same logits."""
    with LlamaModel(tiny_target, LoadParams(**EXACT)) as m:
        s = m.seqs[0]
        want = np.array(s.decode(PROMPT[:20], "last"))
        state = s.state()
        with pytest.raises(RuntimeError, match="refused"):
            s.set_state(state[:len(state) // 2], PROMPT[:20])
        assert s.tokens == []
        np.testing.assert_array_equal(np.array(s.decode(PROMPT[:20], "last")), want)


def test_the_bench_names_the_copy_prompts_are_decoded_on(helped, alone, tiny_target):
    """A benchmark's report lists the prefill helper's file beside the target (for a derived
    format it may be another file than the target's), and nothing where there is none."""
    from via_edge.bench.runner import model_facts

    assert model_facts(helped)["prefill helper"]["path"] == str(tiny_target)
    assert "prefill helper" not in model_facts(alone)


def test_a_damaged_source_is_not_taken_for_the_helper(derived, tmp_path, monkeypatch):
    """A catalog file of the right size but changed since it was hashed (here its GGUF magic
    overwritten: llama.cpp cannot load it) is no longer the format's source: the engine starts,
    and its helper is the format's own file, not a load error."""
    source, variant = derived
    models, elsewhere = tmp_path / "models", tmp_path / "mine"
    models.mkdir()
    elsewhere.mkdir()
    shipped = models / "tiny-src.gguf"
    shipped.write_bytes(source.read_bytes())
    mine = elsewhere / variant.name  # not beside a copy of its source: only the catalog can name it
    mine.write_bytes(variant.read_bytes())
    sha = catalog.sha256_cached(shipped)
    cat = tmp_path / "catalog.json"
    cat.write_text(json.dumps({"models": {"tiny-src": {
        "architecture": "qwen2", "file": shipped.name, "size": shipped.stat().st_size, "sha256": sha,
        "huggingface": {"repo": "nobody/tiny", "file": shipped.name}, "pypi": {"member": "x", "packages": []}}},
        "pairs": {}, "default_pair": None}))
    monkeypatch.setenv("VIA_EDGE_CATALOG", str(cat))
    monkeypatch.setenv("VIA_EDGE_MODEL_DIR", str(models))
    assert formats.source_file(mine) == shipped
    with open(shipped, "r+b") as f:
        f.write(b"\0\0\0\0")
    assert shipped.stat().st_size == len(source.read_bytes()) and formats.source_file(mine) is None
    with Engine(mine, mode="ar", prefill_helper=True, **EXACT) as engine:
        assert engine.target.prefiller.helper.path == mine
        assert len(engine.generate(PROMPT, max_tokens=4).tokens) == 4
